"""The smallest complete torchrun + DDP program: a linear model learns y = 3x - 1 from a range of numbers.

    torchrun --standalone --nproc-per-node 2 03_ddp_torchrun/elastic_ddp.py
    torchrun --nnodes 1 --nproc-per-node 2 --rdzv-id 100 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:29400 03_ddp_torchrun/elastic_ddp.py
    make ddp-minimal NPROC=2

torchrun runs this file as __main__ in every worker, so nothing here spawns processes; the
`if __name__ == "__main__"` guard is good habit, not a necessity as it is with mp.spawn.
"""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import workarounds
from tools import course


class RangeDataset(Dataset):
    """The numbers 0 .. length-1 as floats: easy to see which sample went to which rank."""

    def __init__(self, length: int):
        self.data = torch.arange(length, dtype=torch.float32)

    def __getitem__(self, index):
        return self.data[index]

    def __len__(self):
        return len(self.data)


def train(rank, device):
    model = DDP(nn.Linear(1, 1).to(device), device_ids=[device.index] if device.type == "cuda" else None)
    dataset = RangeDataset(10_000)  # the numbers 0 .. 9999
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)  # rank and world size from the group
    loader = DataLoader(dataset, batch_size=100, sampler=sampler)  # no shuffle=True: the sampler shuffles
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for numbers in course.progress(loader, rank, desc=f"epoch {epoch + 1}"):  # a bar on rank 0 only
            x = (numbers / 10_000).unsqueeze(1).to(device)  # inputs in [0, 1)
            loss = nn.functional.mse_loss(model(x), 3 * x - 1)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        course.print0(rank, f"epoch {epoch + 1}: loss={loss.item():.5f}")
    weight, bias = model.module.weight.item(), model.module.bias.item()
    course.print0(rank, f"learned y = {weight:.3f}x {bias:+.3f} (target y = 3x - 1)")


if __name__ == "__main__":
    if "LOCAL_RANK" not in os.environ:  # started with python, or with --help
        sys.exit("error: torchrun starts this script: torchrun --standalone --nproc-per-node 2 "
                 "03_ddp_torchrun/elastic_ddp.py")
    local_rank = int(os.environ["LOCAL_RANK"])  # set by torchrun, like RANK and WORLD_SIZE
    # CUDA + NCCL when the node has a GPU for every worker, else CPU + Gloo
    device, backend = course.choose_device(local_rank=local_rank, procs_per_node=int(os.environ["LOCAL_WORLD_SIZE"]))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=60), device_id=device if backend == "nccl" else None)
    course.say(f"start running the basic DDP example on rank {dist.get_rank()} ({device})")
    try:
        train(dist.get_rank(), device)
        dist.barrier()  # every rank finishes its work before any tears the group down
    finally:
        workarounds.free_ddp_models()  # workaround: free DDP objects before the group goes, or exit can abort
        dist.destroy_process_group()
