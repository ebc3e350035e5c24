"""A user's script that streams its training data through an IterableDataset: each rank reads its own items
(rank, rank + world_size, ...), or, with --unsharded, every rank reads every item.

    torchrun --standalone --nproc-per-node 2 iterable_stream.py [--unsharded]
"""

import argparse
import datetime

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset


class Stream(IterableDataset):
    """Records read one after another, as from a file too big to index."""

    def __init__(self, n, sharded):
        self.n, self.sharded = n, sharded

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        start, step = (dist.get_rank(), dist.get_world_size()) if self.sharded else (0, 1)
        for i in range(self.n):
            x = torch.randn(16, generator=g)
            if i % step == start:
                yield x, (x[:4].sum() > 0).long()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--unsharded", action="store_true", help="every rank reads the whole stream")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        loader = DataLoader(Stream(800, sharded=not args.unsharded), batch_size=16)
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(16, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for epoch in range(args.epochs):
            for x, y in loader:
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
            if dist.get_rank() == 0:
                print(f"epoch {epoch + 1}: loss {loss.item():.4f}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
