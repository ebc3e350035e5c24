"""The smallest complete DDP program: a linear model learns y = 3x - 1 from the numbers 0 .. 9999.

    torchrun --standalone --nproc-per-node 2 03_ddp_torchrun/elastic_ddp.py

torchrun runs this file as __main__ in a fresh interpreter per process and pickles nothing, so the
`if __name__ == "__main__":` guard below is good habit, not a necessity as it is with mp.spawn.
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


def train(epochs, device, rank):
    model = DDP(nn.Linear(1, 1).to(device), device_ids=[device.index] if device.type == "cuda" else None)
    dataset = TensorDataset(torch.arange(10_000) / 10_000)  # the numbers 0 .. 9999, scaled into [0, 1)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)  # this rank's share; rank and size from the group
    loader = DataLoader(dataset, batch_size=100, sampler=sampler)  # no shuffle=True: the sampler shuffles
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for epoch in range(epochs):
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
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])  # torchrun sets it, with RANK, WORLD_SIZE and LOCAL_WORLD_SIZE
    if torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"]):  # a GPU for every process here
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    else:  # the CPU, which Gloo serves
        device, backend = torch.device("cpu"), "gloo"
    # env:// from torchrun; a rank that waits a minute for another in a collective fails instead of hanging
    dist.init_process_group(backend, timeout=timedelta(seconds=60), device_id=device if backend == "nccl" else None)
    try:
        train(args.epochs, device, dist.get_rank())
    finally:
        gc.collect()  # a workaround, not DDP: free the DDP model (it lives in reference cycles) before its group
        dist.destroy_process_group()  # also after an error


if __name__ == "__main__":
    main()
