"""Point-to-point communication: blocking send/recv, non-blocking isend/irecv, and a ring pass.

    torchrun --standalone --nproc-per-node 2 05_collectives/p2p.py
    make p2p NPROC=3

Gloo on CPU tensors, or NCCL on GPU tensors when there is one GPU per process (--backend picks).

Every rank's tensor before and after each step is printed by rank 0 as one table.
"""

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist

import common


def show(rank, title, before, after):
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, (before.tolist(), after.tolist()))
    if rank == 0:
        print(title)
        for r, (b, a) in enumerate(rows):
            print(f"    rank {r}: {str(b):<14} -> {a}")
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    parser.add_argument("--timeout", type=float, default=30.0)
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
        rank, ws = dist.get_rank(), dist.get_world_size()
        if ws < 2:
            parser.error("needs at least 2 processes")
        if rank == 0:
            print(f"{ws} ranks, backend {backend}, device {device.type}, torch {torch.__version__}")

        # 1. blocking: rank 0 sends, rank 1 receives; both wait until the transfer is done
        x = torch.tensor([float(rank)], device=device)
        before = x.clone()
        if rank == 0:
            x += 100
            dist.send(x, dst=1)
        elif rank == 1:
            dist.recv(x, src=0)  # overwrites x with what rank 0 sent
        show(rank, "send/recv: rank 0 adds 100 and sends to rank 1 (other ranks idle)", before, x)

        # 2. non-blocking: isend/irecv return at once; touch the tensor only after wait()
        x = torch.tensor([float(rank)], device=device)
        before = x.clone()
        if rank == 0:
            x += 100
            req = dist.isend(x, dst=1)  # x must not be modified until req.wait()
        elif rank == 1:
            req = dist.irecv(x, src=0)  # x is not valid until req.wait()
        if rank in (0, 1):
            polled = req.is_completed()  # asks, never blocks; Gloo marks a send or receive done only inside wait()
            req.wait()
        show(rank, "isend/irecv: the same, without blocking until wait()", before, x)
        if rank == 0:
            print(f"    rank 0's request: is_completed() {polled} before wait(), {req.is_completed()} after")

        # 3. a ring: every rank sends to the next and receives from the previous, all at once
        send = torch.tensor([10.0 * rank], device=device)
        recv = torch.zeros(1, device=device)
        ops = [dist.P2POp(dist.isend, send, (rank + 1) % ws), dist.P2POp(dist.irecv, recv, (rank - 1) % ws)]
        for req in dist.batch_isend_irecv(ops):  # posted together: no rank waits for a send to finish first
            req.wait()
        rows = show(rank, "ring with batch_isend_irecv: each rank receives from rank - 1", send, recv)
        if rank == 0:
            ok = all(rows[r][1] == [10.0 * ((r - 1) % ws)] for r in range(ws))
            print(f"result: ring {'correct' if ok else 'WRONG'}")
        dist.barrier()  # every rank finishes its work before any tears the group down
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
