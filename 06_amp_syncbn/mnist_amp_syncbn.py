"""Step 6 of the MNIST chain: mixed precision (autocast + GradScaler) and SyncBatchNorm.

    torchrun --standalone --nproc-per-node 2 06_amp_syncbn/mnist_amp_syncbn.py               # bf16 on CPU, fp16 on GPU
    torchrun --standalone --nproc-per-node 2 06_amp_syncbn/mnist_amp_syncbn.py --amp off --sync-bn
    torchrun --standalone --nproc-per-node 2 06_amp_syncbn/mnist_amp_syncbn.py --use_mix_precision --clip-grad 1
    make amp-syncbn NPROC=2

--sync-bn uses nn.SyncBatchNorm on GPUs; on CPUs (where it cannot train) the all_reduce batch norm of
syncbn_by_hand.py, which computes the same statistics. Copy that file along if you copy this one.
"""

import argparse
import gc
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

import common


def train(args, device, rank, world_size):
    common.seed_everything(args.seed)
    train_set = common.load_dataset(args.dataset, args.data_dir, train=True)
    test_set = common.load_dataset(args.dataset, args.data_dir, train=False)
    # DDP: each rank its own shard; one shared permutation per epoch, cut into world_size disjoint parts
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, pin_memory=device.type == "cuda")
    # DDP: exact evaluation, rank r takes test images r, r+world_size, ...: disjoint, nothing padded
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world_size)), batch_size=1000)

    model = common.ConvNet().to(device)
    if args.sync_bn and device.type == "cuda":  # SyncBN: convert BEFORE the DDP wrap, the documented order
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    elif args.sync_bn:  # SyncBN: nn.SyncBatchNorm trains on GPUs only; the same statistics by hand, one all_reduce
        from syncbn_by_hand import convert_batchnorm
        model = convert_batchnorm(model)
    # DDP: copies rank 0's weights to every rank now, then averages the gradients in every backward()
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.amp)  # AMP: None is full precision
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")  # AMP: fp16 gradients would underflow
    path = os.path.join(args.checkpoint_dir, "mnist_amp_syncbn.pt") if args.checkpoint_dir else ""
    start_epoch = 0
    if path and os.path.exists(path):  # continue a run: every rank reads the same checkpoint
        state = torch.load(path, map_location=device, weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])  # AMP: its scale, and when to grow it
        start_epoch = state["epoch"]
        if rank == 0:
            print(f"resumed from {path} after epoch {start_epoch}")

    start = time.time()
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # DDP: a new order every epoch, the same permutation on every rank
        model.train()
        train_sums = torch.zeros(2, dtype=torch.float64, device=device)  # this rank's loss x samples, samples
        bar = tqdm(train_loader, desc=f"epoch {epoch + 1}", disable=None if rank == 0 else True)  # rank 0, a terminal
        for step, (images, labels) in enumerate(bar):
            if args.max_steps and step == args.max_steps:  # --max-steps: a short epoch (smoke runs, CI)
                break
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            # AMP: the forward in lower precision where it is safe (matmuls, convolutions), fp32 elsewhere
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()  # AMP: backward of the scaled loss (DDP all-reduces as it goes)
            if args.clip_grad:
                scaler.unscale_(optimizer)  # AMP: clip the true gradients, not the scaled ones
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            scaler.step(optimizer)  # AMP: skipped if the scaled gradients overflowed
            scaler.update()  # AMP: a smaller scale after an overflow, a bigger one after a long calm
            train_sums[0] += loss.detach() * len(labels)  # on the device: no wait for the GPU here
            train_sums[1] += len(labels)
            if rank == 0 and args.log_every and (step + 1) % args.log_every == 0:
                print(f"step: epoch={epoch + 1} step={step + 1} loss={loss.item():.4f}")

        for buffer in model.module.buffers():  # DDP: rank 0's BatchNorm statistics everywhere (see README)
            dist.broadcast(buffer, src=0)
        # sums over this rank's part of the test set, and over its training batches
        totals = torch.cat([common.evaluate(model.module, test_loader, device), train_sums])
        dist.all_reduce(totals)  # DDP: the sums of all ranks, on every rank: one all_reduce for every metric
        correct, samples, loss_sum, train_loss_sum, trained = totals.tolist()
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: train_loss={train_loss_sum / trained:.4f} "
                  f"test_loss={loss_sum / samples:.4f} test_acc={correct / samples:.4f}")
        if rank == 0 and path:  # DDP: one writer is enough, every rank holds the same weights
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scaler": scaler.state_dict(), "epoch": epoch + 1}
            os.makedirs(args.checkpoint_dir, exist_ok=True)
            torch.save(state, path + ".tmp")
            os.replace(path + ".tmp", path)  # a crash while saving leaves the last good checkpoint
    if rank == 0 and start_epoch < args.epochs:
        print(f"final: test_acc={correct / samples:.4f} test_samples={int(samples)} world_size={world_size} "
              f"epochs={args.epochs} seconds={time.time() - start:.1f} dataset={args.dataset} "
              f"amp={args.amp} sync_bn={args.sync_bn}")


@record  # torchrun: on failure, its summary shows this worker's real traceback
def main():
    parser = argparse.ArgumentParser(description="MNIST with DDP, mixed precision and SyncBatchNorm (torchrun).")
    parser.add_argument("--amp", default="auto", choices=("auto", "off", "fp16", "bf16"),
                        help="mixed precision; auto = bf16 where the device computes in it (CPU, Ampere+), else fp16")
    parser.add_argument("--use_mix_precision", action="store_const", const="fp16", dest="amp", help="= --amp fp16")
    parser.add_argument("--sync-bn", action="store_true", help="BatchNorm statistics over all ranks' samples")
    parser.add_argument("--clip-grad", type=float, help="clip the gradient norm to this")
    parser.add_argument("--local-rank", "--local_rank", type=int, help="passed by the deprecated launcher; unused")
    args = common.add_training_flags(parser).parse_args()
    # DDP: torchrun tells each process its place: RANK among all, LOCAL_RANK among those on this node
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_world_size = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    device, backend = common.device_and_backend(args.device, args.backend, local_rank, local_world_size)
    if args.amp == "auto":  # AMP: bf16 on the CPU and on GPUs that compute in it (Ampere and newer), else fp16
        args.amp = "bf16" if device.type == "cpu" or torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"
    if device.type == "cuda":
        torch.cuda.set_device(device)  # DDP: this process's GPU; every later CUDA and NCCL call uses it
    # DDP: env:// reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; NCCL gets this process's GPU
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout),
                            device_id=device if backend == "nccl" else None)
    try:
        if local_rank == 0:  # one process per node downloads or writes the data ...
            common.prepare_data(args.dataset, args.data_dir)
        dist.barrier()  # DDP: ... while the others wait here (run `make data` first for a slow download)
        args.dataset = common.prepare_data(args.dataset, args.data_dir, download=False)  # which one `auto` took
        if rank == 0:
            print(f"{world_size} processes on {device.type} with {backend}, amp {args.amp}, sync-bn {args.sync_bn}")
        train(args, device, rank, world_size)
    finally:
        gc.collect()  # a workaround, not DDP: free the DDP model (it lives in reference cycles) before its group
        dist.destroy_process_group()  # DDP: leave the group, also after an error


if __name__ == "__main__":
    main()
