"""Can a process group form here? Each rank reports itself, then one all_reduce proves the group works.

    torchrun --standalone --nproc-per-node 2 03_ddp_torchrun/init_check.py
    make init-check NPROC=2
    python -m torch.distributed.launch --nnodes 1 03_ddp_torchrun/init_check.py   # the blog's way, deprecated
    # two machines, the same command on each with its own --node-rank:
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-addr 10.0.0.1 --master-port 29500 \\
        03_ddp_torchrun/init_check.py

Run this first on a new cluster: if it hangs or fails, training will too, and this is quicker to read.
"""

import argparse
import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import common


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the other ranks")
    # the deprecated launcher (python -m torch.distributed.launch, the blog's way) passes --local-rank=N; torchrun
    # does not, and both set LOCAL_RANK, which is what this script reads
    parser.add_argument("--local-rank", "--local_rank", type=int, help="passed by the deprecated launcher; unused")
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])  # torchrun sets it, with RANK, WORLD_SIZE and LOCAL_WORLD_SIZE
    procs_per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    device, backend = common.device_and_backend(args.device, args.backend, local_rank, procs_per_node)
    if int(os.environ["RANK"]) == 0:
        print(f"torch {torch.__version__}, {torch.cuda.device_count()} CUDA GPU(s) visible; this run: "
              f"{procs_per_node} process(es) per node on {device.type} with {backend}", flush=True)
    if device.type == "cuda":
        torch.cuda.set_device(device)

    # every rank prints: the newline inside the string and end="" make one write, so lines never mix
    print(f"[pid {os.getpid()}] initialising the process group ({backend}, timeout {args.timeout:g} s)\n", end="",
          flush=True)
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout),  # env:// from torchrun
                            device_id=device if backend == "nccl" else None)  # NCCL: bind this GPU now
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        print(f"[pid {os.getpid()}] rank={rank} local_rank={local_rank} world_size={world_size} "
              f"backend={dist.get_backend()} device={device} host={socket.gethostname()}\n", end="", flush=True)
        total = torch.ones(1, device=device)
        dist.all_reduce(total)  # every rank adds 1: the sum must be the world size
        ok = int(total.item()) == world_size
        if rank == 0:
            print(f"process group of {world_size} is {'OK' if ok else 'broken'}: all_reduce of ones = "
                  f"{int(total.item())}", flush=True)
    finally:
        dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
