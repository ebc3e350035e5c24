"""Data parallelism by hand: broadcast the initial weights, all_reduce the gradients, step.

This is what DistributedDataParallel does (minus its buckets and overlap). The script trains the
same model both ways on the same data and shows that the weights agree.

    torchrun --standalone --nproc-per-node 2 05_collectives/ddp_from_scratch.py
    make ddp-from-scratch NPROC=2
"""

import argparse
import gc
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import common


def train(model, rank, steps, sync_by_hand):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)  # every rank its own data
    for _ in range(steps):
        x, y = torch.randn(16, 10, generator=g), torch.randn(16, 5, generator=g)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if sync_by_hand:
            for p in model.parameters():  # the whole of data parallelism, in three lines
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad /= dist.get_world_size()
        optimizer.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args()
    if "RANK" not in os.environ:
        parser.error("start me with torchrun, e.g. torchrun --standalone --nproc-per-node 2 " + __file__)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    try:
        rank = dist.get_rank()

        torch.manual_seed(rank)  # deliberately different initial weights on every rank...
        by_hand = common.ToyModel()
        for p in by_hand.parameters():
            dist.broadcast(p.data, src=0)  # ...so start from rank 0's, as DDP does at construction
        mine = train(by_hand, rank, args.steps, sync_by_hand=True)

        torch.manual_seed(rank)
        ddp = DDP(common.ToyModel())  # broadcasts rank 0's weights, all-reduces gradients in backward
        theirs = train(ddp, rank, args.steps, sync_by_hand=False)

        diff = (mine - theirs).abs().max()
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        spread = mine.clone()
        dist.broadcast(spread, src=0)
        same_everywhere = torch.tensor([float(torch.equal(spread, mine))])
        dist.all_reduce(same_everywhere, op=dist.ReduceOp.MIN)
        common.print0(rank, f"{dist.get_world_size()} ranks, {args.steps} SGD steps on different data per rank")
        common.print0(rank, f"  by hand: weights identical on all ranks: {bool(same_everywhere.item())}")
        common.print0(rank, f"  by hand vs DistributedDataParallel: max |difference| = {diff.item():.2e}")
        common.print0(rank, f"result: max_diff={diff.item():.3e} allclose={torch.allclose(mine, theirs, atol=1e-6)}")
        dist.barrier()  # every rank finishes its work before any tears the group down
    finally:
        gc.collect()  # free the DDP model while the group still exists (see 02's pitfalls)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    common.leave()  # skip the interpreter teardown that can abort (see common.leave)
