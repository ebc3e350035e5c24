"""Uneven inputs: rank r holds 4 + r batches of its own data (an IterableDataset sharded by rank). Without Join the
job fails at the group's timeout; with Join it finishes.

    torchrun --standalone --nproc-per-node 2 07_beyond_ddp/uneven_join.py          # fails after --timeout
    torchrun --standalone --nproc-per-node 2 07_beyond_ddp/uneven_join.py --join   # finishes
    make uneven NPROC=2                                                            # both, one after the other
"""

import argparse
import gc
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset

import common


class RankShard(IterableDataset):
    """This rank's own samples, generated here: rank r yields (batches + r) x batch_size of them."""

    def __init__(self, rank: int, batches: int, batch_size: int):
        self.rank, self.samples = rank, (batches + rank) * batch_size

    def __iter__(self):
        g = torch.Generator().manual_seed(self.rank)
        for _ in range(self.samples):
            x = torch.randn(10, generator=g)
            yield x, x[:5] * 2  # a learnable target for ToyModel's 5 outputs


def train(args, rank: int) -> torch.Tensor:
    """The loop, in a function of its own: the DDP model is dropped when it returns, before the group ends."""
    torch.manual_seed(0)
    model = DDP(common.ToyModel())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(RankShard(rank, args.batches, args.batch_size), batch_size=args.batch_size)
    seen = torch.zeros(1)
    # Join: a rank whose data has ended answers the others' all-reduces with zeros until every rank has ended
    with Join([model], enable=args.join):  # enable=False: the loop as it would be without Join
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP: an all-reduce every rank must join; without Join rank 1's fifth finds no one
            optimizer.step()
            seen += len(x)
    return seen


@record
def main():
    parser = argparse.ArgumentParser(description="Ranks with different numbers of batches, with and without Join.")
    parser.add_argument("--join", action="store_true", help="wrap the training loop in Join([model])")
    parser.add_argument("--batches", type=int, default=4, help="batches of rank 0; rank r has r more")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds a collective may wait (default 5)")
    args = parser.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    try:
        seen = train(args, rank)
        if rank == 0:
            print(f"rank 0: trained on {int(seen)} samples, waiting for the others", flush=True)
        # Gloo: rank 0's next collective, a barrier that names the ranks that do not arrive within the timeout
        dist.monitored_barrier(timeout=timedelta(seconds=args.timeout), wait_all_ranks=True)
        dist.all_reduce(seen)
        if rank == 0:
            print(f"final: samples={int(seen)} world_size={world_size} join={args.join}")
    finally:
        gc.collect()  # a workaround, not DDP: free the DDP model (it lives in reference cycles) before its group
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
