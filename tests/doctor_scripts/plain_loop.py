"""A user's plain DDP loop: toy tensors, a DistributedSampler for training, a Subset per rank for evaluation, the
sums all-reduced, the group destroyed in a `finally`.

    torchrun --standalone --nproc-per-node 2 plain_loop.py [--eval-with-grad] [--crash-in-epoch 2] [--device cuda]
"""

import argparse
import datetime
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def evaluate(model, loader, device):
    model.eval()
    sums = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        sums += torch.stack([(model(x).argmax(1) == y).sum(), torch.tensor(len(y), device=device)])
    dist.all_reduce(sums)
    return (sums[0] / sums[1]).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--eval-with-grad", action="store_true", help="evaluate without torch.no_grad()")
    parser.add_argument("--crash-in-epoch", type=int, default=0)
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(args.device, local_rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=60))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1000, 16, generator=g)
        y = (x[:, :4].sum(1) > 0).long()
        train_set, test_set = TensorDataset(x[:800], y[:800]), TensorDataset(x[800:], y[800:])
        sampler = DistributedSampler(train_set, shuffle=True)
        train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
        test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), batch_size=50)
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2)).to(device))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            for step, (xb, yb) in enumerate(train_loader):
                if epoch + 1 == args.crash_in_epoch and rank == 1 and step == 1:
                    raise ValueError(f"labels out of range in batch {step} of epoch {epoch + 1}")
                optimizer.zero_grad()
                F.cross_entropy(model(xb.to(device)), yb.to(device)).backward()
                optimizer.step()
            if args.eval_with_grad:
                accuracy = evaluate(model, test_loader, device)
            else:
                with torch.no_grad():
                    accuracy = evaluate(model, test_loader, device)
            if rank == 0:
                print(f"epoch {epoch + 1}: accuracy {accuracy:.4f}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
