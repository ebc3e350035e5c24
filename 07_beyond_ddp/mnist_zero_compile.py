"""Beyond DDP, side step: the chain's DDP training with two switches, --zero (ZeroRedundancyOptimizer: each rank
keeps the optimizer state of about 1/N of the parameters) and --compile (torch.compile of the model inside DDP;
`--compile aot_eager` needs no C++ compiler).

    torchrun --standalone --nproc-per-node 2 07_beyond_ddp/mnist_zero_compile.py --zero --checkpoint-dir runs/zero
    torchrun --standalone --nproc-per-node 2 07_beyond_ddp/mnist_zero_compile.py --compile
    make zero NPROC=2
    make compile NPROC=2            # on the CPU, first checks that there is a C++ compiler, then torchrun
"""

import argparse
import gc
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.optim import ZeroRedundancyOptimizer
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
    if args.compile:  # compile: the module inside DDP, before the wrap ("Where to apply torch.compile?", README)
        model.compile(backend=args.compile)
    # DDP: copies rank 0's weights to every rank now, then averages the gradients in every backward()
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if args.zero:  # ZeRO: this rank keeps the momentum of its part of the parameters only
        optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=args.lr, momentum=0.9)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    path = os.path.join(args.checkpoint_dir, "mnist_zero_compile.pt") if args.checkpoint_dir else ""
    start_epoch = 0
    if path and os.path.exists(path):  # continue a run: every rank reads the same checkpoint
        state = torch.load(path, map_location=device, weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])  # ZeRO: the whole state; each rank keeps its part
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
            step_start = time.time()
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP: all-reduces the gradients here, bucket by bucket, while backward runs
            optimizer.step()  # ZeRO: updates this rank's part, then broadcasts it to the others
            if rank == 0 and args.compile and epoch == start_epoch and step in (0, 1):  # the first step compiles
                if device.type == "cuda":
                    torch.cuda.synchronize()  # the GPU runs behind the CPU: wait for it before reading the clock
                print(f"compile: step {step + 1} took {time.time() - step_start:.2f} s")
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
        if path and args.zero:  # ZeRO: gathers every rank's part on rank 0: a collective, so on EVERY rank
            optimizer.consolidate_state_dict(to=0)
        if rank == 0 and path:  # DDP: one writer is enough, every rank holds the same weights
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch + 1}
            os.makedirs(args.checkpoint_dir, exist_ok=True)
            torch.save(state, path + ".tmp")
            os.replace(path + ".tmp", path)  # a crash while saving leaves the last good checkpoint
    if rank == 0 and start_epoch < args.epochs:
        print(f"final: test_acc={correct / samples:.4f} test_samples={int(samples)} world_size={world_size} "
              f"epochs={args.epochs} seconds={time.time() - start:.1f} dataset={args.dataset}")


@record  # torchrun: on failure, its summary shows this worker's real traceback
def main():
    parser = argparse.ArgumentParser(description="MNIST with DDP, ZeRO (--zero) and torch.compile (--compile).")
    parser.add_argument("--zero", action="store_true", help="shard the optimizer state (ZeroRedundancyOptimizer)")
    parser.add_argument("--compile", nargs="?", const="inductor", metavar="BACKEND",
                        help="torch.compile the model (backend: inductor; aot_eager needs no C++ compiler)")
    parser.add_argument("--local-rank", "--local_rank", type=int, help="passed by the deprecated launcher; unused")
    args = common.add_training_flags(parser).parse_args()
    # DDP: torchrun tells each process its place: RANK among all, LOCAL_RANK among those on this node
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_world_size = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    device, backend = common.device_and_backend(args.device, args.backend, local_rank, local_world_size)
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
            print(f"{world_size} processes, {local_world_size} on this node, on {device.type} with {backend}")
        train(args, device, rank, world_size)
    finally:
        gc.collect()  # a workaround, not DDP: free the DDP model (it lives in reference cycles) before its group
        dist.destroy_process_group()  # DDP: leave the group, also after an error


if __name__ == "__main__":
    main()
