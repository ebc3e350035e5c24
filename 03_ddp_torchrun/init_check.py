"""Can a process group form here? Each rank reports itself, then one all_reduce proves the group works.

    torchrun --standalone --nproc-per-node 2 03_ddp_torchrun/init_check.py
    make init-check NPROC=2
    # two machines, the same command on each with its own --node-rank:
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-addr 10.0.0.1 --master-port 29500 \\
        03_ddp_torchrun/init_check.py

Run this first on a new cluster: if it hangs or fails, training will too, and this is quicker to read.
"""

import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from tools import course


def main():
    parser = course.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the other ranks")
    course.accept_local_rank(parser)  # what the deprecated torch.distributed.launch passes
    args = parser.parse_args()
    if "RANK" not in os.environ:
        parser.error("start me with torchrun, e.g. torchrun --standalone --nproc-per-node 2 " + __file__)
    # without LOCAL_RANK (started by hand with RANK and WORLD_SIZE exported, or by the old launcher): its
    # --local-rank, or on one machine local rank = rank
    fallback = args.local_rank if args.local_rank >= 0 else int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", fallback))
    procs_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    try:
        device, backend = course.choose_device(args.device, args.backend, local_rank=local_rank,
                                               procs_per_node=procs_per_node)
    except course.UsageError as err:
        parser.error(str(err))
    course.print0(int(os.environ["RANK"]), course.runtime_report(device, backend, procs_per_node))
    if device.type == "cuda":
        torch.cuda.set_device(device)

    course.say(f"[pid {os.getpid()}] initialising the process group ({backend}, timeout {args.timeout:g} s)")
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout),  # env:// from torchrun
                            device_id=device if backend == "nccl" else None)  # NCCL: bind this GPU now
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        course.say(f"[pid {os.getpid()}] rank={rank} local_rank={local_rank} world_size={world_size} "
                   f"backend={dist.get_backend()} device={device} host={socket.gethostname()}")
        total = torch.ones(1, device=device)
        dist.all_reduce(total)  # every rank adds 1: the sum must be the world size
        ok = int(total.item()) == world_size
        course.print0(rank, f"process group of {world_size} is {'OK' if ok else 'broken'}: "
                            f"all_reduce of ones = {int(total.item())}")
    finally:
        dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
