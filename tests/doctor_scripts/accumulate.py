"""A user's script that accumulates gradients over 2 batches and skips the all-reduce of the first with no_sync().

    torchrun --standalone --nproc-per-node 2 accumulate.py
"""

import contextlib
import datetime

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

ACCUMULATE = 2


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(800, 16, generator=g)
        data = TensorDataset(x, (x[:, :4].sum(1) > 0).long())
        sampler = DistributedSampler(data)
        loader = DataLoader(data, batch_size=8, sampler=sampler)
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for epoch in range(2):
            sampler.set_epoch(epoch)
            for i, (xb, yb) in enumerate(loader):
                last = (i + 1) % ACCUMULATE == 0
                with contextlib.nullcontext() if last else model.no_sync():
                    (F.cross_entropy(model(xb), yb) / ACCUMULATE).backward()
                if last:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
