"""A user's script in the style of pytorch/examples' DDP tutorial series: a Trainer class that saves snapshots.

    torchrun --standalone --nproc-per-node 2 trainer_style.py [--bug no-sampler|no-set-epoch|every-rank-saves]
"""

import argparse
import gc
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class Points(Dataset):
    def __init__(self, n=2000):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 20, generator=g)
        self.y = (self.x[:, 0] > 0).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Trainer:
    def __init__(self, model, loader, optimizer, rank, bug, snapshot):
        self.model, self.loader, self.optimizer, self.rank, self.bug = DDP(model), loader, optimizer, rank, bug
        self.snapshot = snapshot

    def _run_epoch(self, epoch):
        if self.bug != "no-set-epoch" and isinstance(self.loader.sampler, DistributedSampler):
            self.loader.sampler.set_epoch(epoch)
        for x, y in self.loader:
            self.optimizer.zero_grad()
            F.cross_entropy(self.model(x), y).backward()
            self.optimizer.step()

    def train(self, epochs):
        for epoch in range(epochs):
            self._run_epoch(epoch)
            if self.rank == 0 or self.bug == "every-rank-saves":
                torch.save(self.model.module.state_dict(), self.snapshot)


def main():
    parser = argparse.ArgumentParser(description="A Trainer-class DDP script (for the doctor's tests).")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--bug", default="", choices=("", "no-sampler", "no-set-epoch", "every-rank-saves"))
    parser.add_argument("--snapshot", default="snapshot.pt")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    train(args)
    gc.collect()  # the DDP model sits in reference cycles: free it before the group goes (or a rank may abort)
    dist.destroy_process_group()


def train(args):
    torch.manual_seed(0)
    data = Points()
    sampler = None if args.bug == "no-sampler" else DistributedSampler(data)
    loader = DataLoader(data, batch_size=32, shuffle=sampler is None, sampler=sampler)
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    trainer = Trainer(model, loader, torch.optim.SGD(model.parameters(), lr=0.1), int(os.environ["RANK"]), args.bug,
                      args.snapshot)
    trainer.train(args.epochs)


if __name__ == "__main__":
    main()
