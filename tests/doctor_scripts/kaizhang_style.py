"""A user's script in the style of Kai Zhang's DDP tutorial: a plain loop, a DistributedSampler on the test set
too, and the evaluation sums reduced to rank 0.

    torchrun --standalone --nproc-per-node 2 kaizhang_style.py [--exact] [--bug no-reduce]
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main():
    parser = argparse.ArgumentParser(description="A plain-loop DDP script (for the doctor's tests).")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--exact", action="store_true", help="shard the test set without padding")
    parser.add_argument("--bug", default="", choices=("", "no-reduce"))
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1601, 16, generator=g)  # 1001 test samples: not divisible by 2 ranks
    y = (x.sum(1) > 0).long()
    train_set, test_set = TensorDataset(x[:600], y[:600]), TensorDataset(x[600:], y[600:])
    sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=16, sampler=sampler)
    if args.exact:
        test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), batch_size=100)
    else:
        test_loader = DataLoader(test_set, batch_size=100, sampler=DistributedSampler(test_set, shuffle=False))
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for xb, yb in train_loader:
            optimizer.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            optimizer.step()
        model.eval()
        correct = torch.zeros(2)
        with torch.no_grad():
            for xb, yb in test_loader:
                correct += torch.tensor([(model(xb).argmax(1) == yb).sum().item(), len(yb)])
        if args.bug != "no-reduce":
            dist.reduce(correct, dst=0)
        if rank == 0:
            print(f"epoch {epoch + 1}: accuracy {correct[0] / correct[1]:.4f} over {int(correct[1])} samples")
    dist.destroy_process_group()
    if os.environ.get("LOCAL_RANK") == "0":
        print("done")


if __name__ == "__main__":
    main()
