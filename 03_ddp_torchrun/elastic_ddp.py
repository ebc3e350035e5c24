"""The smallest complete torchrun + DDP program: a linear model learns y = 3x - 1 from the numbers 0 .. 9999.

    torchrun --standalone --nproc-per-node 2 03_ddp_torchrun/elastic_ddp.py
    torchrun --nnodes 1 --nproc-per-node 2 --rdzv-id 100 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:29400 03_ddp_torchrun/elastic_ddp.py
    make ddp-minimal NPROC=2
"""

import argparse
import gc
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import common


def train(args, device, rank):
    model = DDP(nn.Linear(1, 1).to(device), device_ids=[device.index] if device.type == "cuda" else None)
    dataset = TensorDataset(torch.arange(10_000) / 10_000)  # the numbers 0 .. 9999, scaled into [0, 1)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)  # this rank's share; rank and size from the group
    loader = DataLoader(dataset, batch_size=100, sampler=sampler)  # no shuffle=True: the sampler shuffles
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new order every epoch, the same permutation on every rank
        for (x,) in loader:
            x = x.unsqueeze(1).to(device)
            loss = nn.functional.mse_loss(model(x), 3 * x - 1)
            optimizer.zero_grad()
            loss.backward()  # DDP averages the gradients of all ranks here
            optimizer.step()
        if rank == 0:
            print(f"epoch {epoch + 1}: loss={loss.item():.5f}")
    if rank == 0:
        print(f"learned y = {model.module.weight.item():.3f}x {model.module.bias.item():+.3f} (target y = 3x - 1)")


def main():
    parser = argparse.ArgumentParser(description="The smallest complete DDP program. torchrun starts it: "
                                     "torchrun --standalone --nproc-per-node 2 03_ddp_torchrun/elastic_ddp.py.")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a collective may wait")
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])  # torchrun sets it, with RANK, WORLD_SIZE and LOCAL_WORLD_SIZE
    device, backend = common.device_and_backend(args.device, args.backend, local_rank,
                                                int(os.environ["LOCAL_WORLD_SIZE"]))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout),  # env:// from torchrun
                            device_id=device if backend == "nccl" else None)
    try:
        train(args, device, dist.get_rank())
    finally:
        gc.collect()  # a workaround, not DDP: free the DDP model (it lives in reference cycles) before its group
        dist.destroy_process_group()  # also after an error


if __name__ == "__main__":
    main()
