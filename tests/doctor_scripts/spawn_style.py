"""A user's script that starts its processes itself with mp.spawn, with BatchNorm in the model.

    python spawn_style.py
"""

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def worker(rank, world, args):
    dist.init_process_group("gloo", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, 8, generator=g)
    y = (x[:, :2].sum(1) > 0).long()
    train_set, test_set = TensorDataset(x[:800], y[:800]), TensorDataset(x[800:], y[800:])
    sampler = DistributedSampler(train_set)
    loader = DataLoader(train_set, batch_size=20, sampler=sampler)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), batch_size=50)
    torch.manual_seed(0)
    nn = torch.nn
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for xb, yb in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            optimizer.step()
        net = model.module
        for buffer in net.buffers():  # rank 0's BatchNorm statistics for everyone's evaluation
            dist.broadcast(buffer, src=0)
        net.eval()
        totals = torch.zeros(2)
        with torch.no_grad():
            for xb, yb in test_loader:
                totals += torch.tensor([(net(xb).argmax(1) == yb).sum().item(), len(yb)])
        dist.all_reduce(totals)
        if rank == 0:
            print(f"epoch {epoch + 1}: accuracy {totals[0] / totals[1]:.4f}")
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description="An mp.spawn DDP script (for the doctor's tests).")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    mp.spawn(worker, args=(2, args), nprocs=2)


if __name__ == "__main__":
    main()
