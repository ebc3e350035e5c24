"""A user's script that hangs: rank 0 waits in an all_reduce that rank 1, stuck elsewhere, never calls."""

import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 0:
    dist.all_reduce(torch.ones(1))
else:
    time.sleep(600)
dist.destroy_process_group()
