"""Proof that DDP averages gradients: N ranks x b samples train exactly like 1 process x N*b samples.

Every rank builds the same global batch (seed 1), keeps its own slice of b samples and takes a few SGD
steps (lr 0.1) under DDP, from the same initial weights (seed 0). Each rank prints the first and last three of its
weights; rank 0 then repeats the training alone on the whole batch and prints the largest difference.

    python 02_ddp_spawn/ddp_equivalence.py --nproc 2
    python 02_ddp_spawn/ddp_equivalence.py --nproc 3 --steps 5 --per-rank 32

It runs on the CPU with Gloo on every machine, GPUs or not: the lesson is arithmetic, not devices.

The BatchNorm caveat is checked too: BatchNorm normalises with the statistics of the batch it
sees, which under DDP is each rank's slice. So the DDP run does NOT equal one process on the whole
batch, but it does equal one process that runs BatchNorm on each slice separately and averages
the losses. (SyncBatchNorm, section 06, uses the statistics of the global batch instead.)
"""

import argparse
import gc
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import common


def make_model(batchnorm: bool) -> nn.Module:
    torch.manual_seed(0)  # the same initial weights in every process and in the reference
    if not batchnorm:
        return common.ToyModel()
    return nn.Sequential(nn.Linear(10, 10), nn.BatchNorm1d(10), nn.ReLU(), nn.Linear(10, 5))


def global_batch(world_size, per_rank):
    g = torch.Generator().manual_seed(1)
    return torch.randn(world_size * per_rank, 10, generator=g), torch.randn(world_size * per_rank, 5, generator=g)


def sgd(model, shards, steps, lr):
    """Plain SGD; the loss of a step is the mean over `shards` of each shard's mean squared error."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = sum(nn.functional.mse_loss(model(x), y) for x, y in shards) / len(shards)
        loss.backward()
        optimizer.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


def worker(rank, world_size, args, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=args.timeout))
    try:
        x, y = global_batch(world_size, args.per_rank)
        mine = slice(rank * args.per_rank, (rank + 1) * args.per_rank)  # this rank's b samples
        results = {}
        for bn in (False, True):
            ddp_weights = sgd(DDP(make_model(bn)), [(x[mine], y[mine])], args.steps, args.lr)
            ends = " ".join(f"{w:.8f}" for w in ddp_weights[:3].tolist() + ddp_weights[-3:].tolist())
            # every rank prints its own weights, in one write so that lines never mix: equal on every rank
            print(f"rank {rank}: {'with BatchNorm' if bn else 'ToyModel'} weights, first and last 3: {ends}\n",
                  end="", flush=True)
            if rank == 0:
                whole = sgd(make_model(bn), [(x, y)], args.steps, args.lr)
                halves = [(x[r * args.per_rank:(r + 1) * args.per_rank], y[r * args.per_rank:(r + 1) * args.per_rank])
                          for r in range(world_size)]
                per_shard = sgd(make_model(bn), halves, args.steps, args.lr)
                results[bn] = (max_diff(ddp_weights, whole), max_diff(ddp_weights, per_shard))
        if rank == 0:
            plain, _ = results[False]
            bn_whole, bn_shard = results[True]
            print(f"{world_size} ranks x {args.per_rank} samples vs 1 process x {world_size * args.per_rank}, "
                  f"{args.steps} SGD steps, max |weight difference|:", flush=True)
            print(f"  ToyModel                                      {plain:.2e}", flush=True)
            print(f"  with BatchNorm, reference on the whole batch  {bn_whole:.2e}", flush=True)
            print(f"  with BatchNorm, reference BN on each slice    {bn_shard:.2e}", flush=True)
            ok = plain < 1e-5 and bn_shard < 1e-5 and bn_whole > 1e-4
            print(f"result: plain_diff={plain:.3e} bn_whole_diff={bn_whole:.3e} bn_shard_diff={bn_shard:.3e} "
                  f"gradients_averaged={ok}", flush=True)
            if not ok:
                raise SystemExit("DDP did not behave like gradient averaging")
        dist.barrier()  # every rank finishes its work before any tears the group down
    finally:
        gc.collect()  # a workaround, not DDP: free the DDP model (it lives in reference cycles) before its group
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--per-rank", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args()
    if args.nproc < 2 or args.per_rank < 2 or args.steps < 1:
        parser.error("--nproc and --per-rank must be at least 2 (BatchNorm needs 2 samples), --steps at least 1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does: N processes x all cores would fight
    try:
        mp.spawn(worker, args=(args.nproc, args, common.free_port()), nprocs=args.nproc, join=True)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
        sys.exit(f"ddp_equivalence: a worker failed.\n{err}")


if __name__ == "__main__":
    main()
