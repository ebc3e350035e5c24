"""A user's script that shards its model with FSDP2 (fully_shard per layer, then the root) instead of DDP.

    torchrun --standalone --nproc-per-node 2 fsdp2_style.py
"""

import datetime

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        mesh = init_device_mesh("cpu", (world,))
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1000, 16, generator=g)
        y = (x[:, :4].sum(1) > 0).long()
        train_set, test_set = TensorDataset(x[:800], y[:800]), TensorDataset(x[800:], y[800:])
        sampler = DistributedSampler(train_set)
        loader = DataLoader(train_set, batch_size=16, sampler=sampler)
        test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), batch_size=50)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for epoch in range(2):
            sampler.set_epoch(epoch)
            model.train()
            for xb, yb in loader:
                optimizer.zero_grad()
                F.cross_entropy(model(xb), yb).backward()
                optimizer.step()
            model.eval()
            sums = torch.zeros(2)
            with torch.no_grad():
                for xb, yb in test_loader:
                    sums += torch.tensor([(model(xb).argmax(1) == yb).sum().item(), len(yb)])
            dist.all_reduce(sums)
            if rank == 0:
                print(f"epoch {epoch + 1}: accuracy {sums[0] / sums[1]:.4f}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
