"""A rank that takes a different path: turn a silent 30-minute hang into an error in seconds.

Two classic mistakes, each run on purpose:

  --mode mismatch   rank 0 runs an extra all_reduce (say, metrics of an evaluation done on rank 0
                    only) while the others go on to a barrier. With TORCH_DISTRIBUTED_DEBUG=DETAIL
                    every collective is checked across ranks first, and the mismatch is reported at once.
  --mode straggler  rank 1 is stuck (here: asleep) while rank 0 waits in monitored_barrier, which
                    names the rank that did not arrive. monitored_barrier exists in Gloo only: with
                    NCCL, call it on a Gloo side group (dist.new_group(backend="gloo")), as done here.

    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone --nproc-per-node 2 05_collectives/hang_demo.py --mode mismatch
    torchrun --standalone --nproc-per-node 2 05_collectives/hang_demo.py --mode straggler
    make hang-demo NPROC=2          # both; the target succeeds when the job fails as it should

Without DETAIL and without a short --timeout, both would wait for the backend's default: 30 minutes
with Gloo, 10 with NCCL.
"""

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import common


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("mismatch", "straggler"), required=True)
    parser.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds any collective may wait")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        parser.error("start me with torchrun, e.g. torchrun --standalone --nproc-per-node 2 " + __file__)
    local_rank, local_ws = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    # Gloo on CPU tensors, NCCL on GPU tensors (one per process)
    device, backend = common.device_and_backend("cpu" if args.backend == "gloo" else "auto", args.backend,
                                                local_rank, local_ws)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout),
                            device_id=device if backend == "nccl" else None)
    try:
        rank = dist.get_rank()
        debug = os.environ.get("TORCH_DISTRIBUTED_DEBUG", "OFF")
        if rank == 0:
            print(f"mode {args.mode}, backend {backend}, TORCH_DISTRIBUTED_DEBUG={debug}, timeout {args.timeout:g} s")
        if args.mode == "mismatch":
            if rank == 0:  # the bug: a collective inside an `if rank == 0:` block
                metrics = torch.ones(4, device=device)
                dist.all_reduce(metrics)
            dist.barrier()  # everyone else is already here
        else:
            # monitored_barrier exists in Gloo only; with NCCL it runs on a Gloo side group, made by all ranks
            gloo = None if backend == "gloo" else dist.new_group(backend="gloo", timeout=timedelta(seconds=60))
            if rank == 1:
                time.sleep(3 * args.timeout)  # stuck: a slow disk, a deadlock, an endless loop...
            dist.monitored_barrier(gloo, timeout=timedelta(seconds=args.timeout / 2), wait_all_ranks=True)
        if rank == 0:
            print("no error: this should not happen")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
