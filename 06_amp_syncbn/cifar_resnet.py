"""ResNet-18 on CIFAR-10 with DDP: augmentation, SGD with momentum and weight decay, mixed precision,
gradient accumulation, exact evaluation every few epochs, rank-0 checkpoints that a new run continues.

    torchrun --standalone --nproc-per-node 2 06_amp_syncbn/cifar_resnet.py --epochs 30
    torchrun --standalone --nproc-per-node 2 06_amp_syncbn/cifar_resnet.py --checkpoint-dir runs/cifar --epochs 30
    torchrun --standalone --nproc-per-node 2 06_amp_syncbn/cifar_resnet.py --accum-steps 4 --eval-every 5
    make cifar-resnet NPROC=2                    # a short run; EPOCHS=N for a real one

Real CIFAR-10 when it is in --data-dir (`make data`), the offline stand-in otherwise. On a CPU,
ResNet-18 trains at about 50 images/s per process: an epoch of the stand-in takes minutes.
"""

import argparse
import contextlib
import gc
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

import common


def augment_cifar(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """CIFAR's standard augmentation for a whole batch at once: random 32x32 crop of the image padded
    by 4 pixels, and a horizontal flip half of the time. One indexing operation, no per-image loop."""
    n, c, h, w = x.shape
    padded = F.pad(x, (4, 4, 4, 4))
    top = torch.randint(0, 9, (n,), generator=generator).to(x.device)
    left = torch.randint(0, 9, (n,), generator=generator).to(x.device)
    rows = (top.view(n, 1) + torch.arange(h, device=x.device)).view(n, 1, h, 1)
    cols = (left.view(n, 1) + torch.arange(w, device=x.device)).view(n, 1, 1, w)
    out = padded[torch.arange(n, device=x.device).view(n, 1, 1, 1), torch.arange(c, device=x.device).view(1, c, 1, 1),
                 rows, cols]
    flip = (torch.rand(n, generator=generator) < 0.5).to(x.device).view(n, 1, 1, 1)
    return torch.where(flip, out.flip(3), out)


def train(args, device, rank, world_size):
    common.seed_everything(args.seed)
    train_set = common.load_dataset(args.dataset, args.data_dir, train=True)
    test_set = common.load_dataset(args.dataset, args.data_dir, train=False)
    # DDP: each rank its own shard; one shared permutation per epoch, cut into world_size disjoint parts
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, pin_memory=device.type == "cuda")
    # DDP: exact evaluation, rank r takes test images r, r+world_size, ...: disjoint, nothing padded
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world_size)), batch_size=500)
    augment_rng = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own crops and flips

    model = common.resnet18_cifar().to(device)
    # DDP: copies rank 0's weights to every rank now, then averages the gradients in every backward()
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.amp)  # AMP: None is full precision
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")  # AMP: fp16 gradients would underflow
    path = os.path.join(args.checkpoint_dir, "cifar_resnet.pt") if args.checkpoint_dir else ""
    start_epoch = 0
    if path and os.path.exists(path):  # continue a run: every rank reads the same checkpoint
        state = torch.load(path, map_location=device, weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])  # AMP: its scale, and when to grow it
        start_epoch = state["epoch"]
        if rank == 0:
            print(f"resumed from {path} after epoch {start_epoch}")
    if rank == 0:
        print(f"ResNet-18 on {args.dataset} ({len(train_set)} train / {len(test_set)} test), {world_size} processes, "
              f"batch {args.batch_size} x {args.accum_steps} accumulation per process, amp {args.amp}")

    start, acc = time.time(), None
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # DDP: a new order every epoch, the same permutation on every rank
        model.train()
        # --max-steps counts optimizer steps: each takes --accum-steps batches
        steps = min(len(train_loader), args.max_steps * args.accum_steps or len(train_loader))
        train_sums = torch.zeros(2, dtype=torch.float64, device=device)  # this rank's loss x samples, samples
        bar = tqdm(train_loader, desc=f"epoch {epoch + 1}", total=steps, disable=None if rank == 0 else True)
        for step, (images, labels) in enumerate(bar):
            if step == steps:
                break
            # augment on the device, after the (pinned, non-blocking) copy: no CPU work per batch
            images = augment_cifar(images.to(device, non_blocking=True), augment_rng)
            labels = labels.to(device, non_blocking=True)
            last_micro = (step + 1) % args.accum_steps == 0 or step + 1 == steps
            # DDP: all-reduce only in the backward of the last micro-batch of an optimizer step
            with contextlib.nullcontext() if last_micro else model.no_sync():
                with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                    loss = F.cross_entropy(model(images), labels) / args.accum_steps
                scaler.scale(loss).backward()  # AMP: the scaled loss; the gradients add up over the micro-batches
            train_sums[0] += loss.detach() * args.accum_steps * len(labels)  # on the device: no wait for the GPU
            train_sums[1] += len(labels)
            if last_micro:
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)

        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            for buffer in model.module.buffers():  # DDP: rank 0's BatchNorm statistics everywhere (see README)
                dist.broadcast(buffer, src=0)
            # sums over this rank's part of the test set, and over its training batches
            totals = torch.cat([common.evaluate(model.module, test_loader, device), train_sums])
            dist.all_reduce(totals)  # DDP: the sums of all ranks, on every rank: one all_reduce for every metric
            correct, samples, loss_sum, train_loss_sum, trained = totals.tolist()
            acc = correct / samples
            if rank == 0:
                print(f"epoch {epoch + 1}/{args.epochs}: train_loss={train_loss_sum / trained:.4f} "
                      f"test_loss={loss_sum / samples:.4f} test_acc={acc:.4f}")
        if rank == 0 and path:  # DDP: one writer is enough, every rank holds the same weights
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scaler": scaler.state_dict(), "epoch": epoch + 1}
            os.makedirs(args.checkpoint_dir, exist_ok=True)
            torch.save(state, path + ".tmp")
            os.replace(path + ".tmp", path)  # a crash while saving leaves the last good checkpoint
    if rank == 0 and acc is not None:
        print(f"final: test_acc={acc:.4f} test_samples={int(samples)} world_size={world_size} epochs={args.epochs} "
              f"seconds={time.time() - start:.1f} dataset={args.dataset} amp={args.amp}")


@record  # torchrun: on failure, its summary shows this worker's real traceback
def main():
    parser = argparse.ArgumentParser(description="ResNet-18 on CIFAR-10 with DDP (torchrun).")
    parser.add_argument("--amp", default="auto", choices=("auto", "off", "fp16", "bf16"),
                        help="mixed precision; auto = bf16 where the device computes in it (CPU, Ampere+), else fp16")
    parser.add_argument("--use_mix_precision", action="store_const", const="fp16", dest="amp", help="= --amp fp16")
    parser.add_argument("--accum-steps", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    parser.add_argument("--eval-every", type=int, default=1, help="evaluate every K epochs, and after the last")
    parser.add_argument("--local-rank", "--local_rank", type=int, help="passed by the deprecated launcher; unused")
    args = common.add_training_flags(parser, datasets=common.CIFAR_DATASETS, batch_size=32, lr=0.05).parse_args()
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
            common.prepare_data(args.dataset, args.data_dir, family="cifar10")
        dist.barrier()  # DDP: ... while the others wait here (run `make data` first for a slow download)
        args.dataset = common.prepare_data(args.dataset, args.data_dir, family="cifar10", download=False)
        if rank == 0:
            print(f"{world_size} processes on {device.type} with {backend}")
        train(args, device, rank, world_size)
    finally:
        gc.collect()  # a workaround, not DDP: free the DDP model (it lives in reference cycles) before its group
        dist.destroy_process_group()  # DDP: leave the group, also after an error


if __name__ == "__main__":
    main()
