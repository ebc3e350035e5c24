"""Data parallelism by hand: broadcast the initial weights, all_reduce the gradients, step.

This is what DistributedDataParallel does (minus its buckets and overlap). The script trains the same model both
ways on the same data and prints a digest of every rank's weights, both ways, and their largest difference. Gloo
on the CPU, or NCCL on GPUs when there is one GPU per process (--backend picks).

    torchrun --standalone --nproc-per-node 2 05_collectives/ddp_from_scratch.py
    make ddp-from-scratch NPROC=2
"""

import argparse
import gc
import os
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import common


def train(model, rank, steps, sync_by_hand, device):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)  # every rank its own data
    for _ in range(steps):
        x, y = torch.randn(16, 10, generator=g).to(device), torch.randn(16, 5, generator=g).to(device)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if sync_by_hand:
            for p in model.parameters():  # the whole of data parallelism, in three lines
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad /= dist.get_world_size()
        optimizer.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def digest(weights) -> str:
    """A short fingerprint of a weight vector (a CRC-32 of its bytes): equal digests, equal weights."""
    return f"{zlib.crc32(weights.cpu().numpy().tobytes()):08x}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args()
    if "RANK" not in os.environ:
        parser.error("start me with torchrun, e.g. torchrun --standalone --nproc-per-node 2 " + __file__)
    local_rank, local_ws = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    # Gloo on CPU tensors, NCCL on GPU tensors (one per process)
    device, backend = common.device_and_backend("cpu" if args.backend == "gloo" else "auto", args.backend,
                                                local_rank, local_ws)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout),
                            device_id=device if backend == "nccl" else None)
    try:
        rank, ws = dist.get_rank(), dist.get_world_size()

        torch.manual_seed(rank)  # deliberately different initial weights on every rank...
        by_hand = common.ToyModel().to(device)
        for p in by_hand.parameters():
            dist.broadcast(p.data, src=0)  # ...so start from rank 0's, as DDP does at construction
        mine = train(by_hand, rank, args.steps, True, device)

        torch.manual_seed(rank)
        # DDP broadcasts rank 0's weights at construction and all-reduces the gradients in backward
        ddp = DDP(common.ToyModel().to(device), device_ids=[device.index] if device.type == "cuda" else None)
        theirs = train(ddp, rank, args.steps, False, device)

        diff = (mine - theirs).abs().max()
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        spread = mine.clone()
        dist.broadcast(spread, src=0)
        same_everywhere = torch.tensor([float(torch.equal(spread, mine))], device=device)
        dist.all_reduce(same_everywhere, op=dist.ReduceOp.MIN)
        held = [None] * ws
        dist.all_gather_object(held, (digest(mine), digest(theirs)))  # what every rank holds, for rank 0 to show
        if rank == 0:
            print(f"{ws} ranks, backend {backend}, device {device.type}: {args.steps} SGD steps on different data "
                  "per rank")
            for r, (hand, wrapped) in enumerate(held):
                print(f"  rank {r}: weights digest by hand {hand}, with DistributedDataParallel {wrapped}")
            print(f"  by hand: weights identical on all ranks: {bool(same_everywhere.item())}")
            print(f"  by hand vs DistributedDataParallel: max |difference| = {diff.item():.2e}")
            print(f"result: max_diff={diff.item():.3e} allclose={torch.allclose(mine, theirs, atol=1e-6)}")
        dist.barrier()  # every rank finishes its work before any tears the group down
    finally:
        gc.collect()  # a workaround, not DDP: free the DDP model (it lives in reference cycles) before its group
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
