"""Every collective, run once with small tensors: each rank's value before and after, and a check.

Each op prints a little table (one line per rank) and compares the result with its closed-form
answer; the script exits with 1 if any op misbehaves. Works with any world size from 2 up, with Gloo
on CPU tensors or NCCL on GPU tensors (one GPU per process). NCCL has no bitwise reductions
(BAND, BOR, BXOR), and Gloo before torch 2.14 has no list form of all_to_all: they are listed as not supported,
not run.

    torchrun --standalone --nproc-per-node 4 05_collectives/collectives.py
    make collectives NPROC=4
"""

import argparse
import math
import os
import sys
from datetime import timedelta
from functools import reduce

import torch
import torch.distributed as dist

import common

FAILED = []
# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor (the old names warn in 2.14); 2.11 has only
# the old names
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
UNSUPPORTED = {"nccl": {"BAND", "BOR", "BXOR"}}  # ReduceOps a backend refuses (see backend_matrix.py)


def has_list_all_to_all(backend, ws, timeout) -> bool:
    """Whether this backend runs the list form of all_to_all. Gloo gained it after torch 2.11, which refuses the call
    on every rank before anything is sent ("Backend gloo does not support alltoall"). Asked once, in a throwaway
    group: a collective that failed must never be caught and carried on with in a group that is used again."""
    probe = dist.new_group(backend=backend, timeout=timeout)
    device = "cuda" if backend == "nccl" else "cpu"
    try:
        dist.all_to_all([torch.zeros(1, device=device) for _ in range(ws)],
                        [torch.zeros(1, device=device) for _ in range(ws)], group=probe)
        return True
    except RuntimeError as refused:
        if "does not support alltoall" not in str(refused):
            raise
        return False
    finally:
        dist.destroy_process_group(probe)


def table(rank, title, before, after, expected=None):
    """Gather every rank's before/after (as text) on all ranks, print on rank 0, check against `expected`.

    `expected` is a function of the rank giving the correct `after`, or None where the result is unspecified.
    """
    ws = dist.get_world_size()
    ok = expected is None or _same(after, expected(rank))
    rows = [None] * ws
    dist.all_gather_object(rows, (_fmt(before), _fmt(after), ok))  # an object collective, used for display
    if rank == 0:
        verdict = "unchecked" if expected is None else ("OK" if all(r[2] for r in rows) else "WRONG")
        print(f"{title}  [{verdict}]")
        for r, (b, a, _) in enumerate(rows):
            print(f"    rank {r}: {b:<28} -> {a}")
    if not all(row[2] for row in rows):
        FAILED.append(title)


def _fmt(value) -> str:
    if torch.is_tensor(value):
        return str(value.tolist())
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return str(value)


def _same(got, want):
    if isinstance(want, list):
        return len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want, strict=True))
    if torch.is_tensor(want):
        return torch.is_tensor(got) and torch.allclose(got.cpu().double(), want.cpu().double())
    return got == want


def run_all(rank, ws, device, backend, timeout):
    def t(*values, dtype=torch.float32):
        return torch.tensor(values, dtype=dtype, device=device)

    total = ws * (ws + 1) // 2  # 1 + 2 + ... + ws

    x = t(10 * rank + 1, 10 * rank + 2)
    before = x.clone()
    dist.broadcast(x, src=0)  # rank 0's tensor everywhere
    table(rank, "broadcast(src=0)", before, x, lambda r: t(1, 2))

    x = t(rank + 1, 2 * (rank + 1))
    before = x.clone()
    dist.reduce(x, dst=0, op=dist.ReduceOp.SUM)  # the sum on rank 0 only
    table(rank, "reduce(dst=0, SUM): other ranks hold partial sums (unspecified)", before, x)
    if rank == 0 and not torch.equal(x, t(total, 2 * total)):
        FAILED.append("reduce")

    reductions = [("SUM", torch.float32, lambda v: sum(v)), ("PRODUCT", torch.float32, math.prod),
                  ("MIN", torch.float32, min), ("MAX", torch.float32, max),
                  ("AVG", torch.float32, lambda v: sum(v) / len(v)),
                  ("BAND", torch.int64, lambda v: reduce(lambda a, b: a & b, v)),
                  ("BOR", torch.int64, lambda v: reduce(lambda a, b: a | b, v)),
                  ("BXOR", torch.int64, lambda v: reduce(lambda a, b: a ^ b, v))]
    values = [r + 1 for r in range(ws)]  # rank r contributes r + 1
    for name, dtype, fn in reductions:
        if name in UNSUPPORTED.get(backend, ()):
            if rank == 0:
                print(f"all_reduce({name})  [not supported by {backend}: not run]")
            continue
        x = t(rank + 1, dtype=dtype)
        before = x.clone()
        dist.all_reduce(x, op=getattr(dist.ReduceOp, name))  # the result on every rank
        table(rank, f"all_reduce({name}, {str(dtype).replace('torch.', '')})", before, x,
              lambda r, fn=fn, dtype=dtype: t(fn(values), dtype=dtype))

    x = t(rank)
    out = [torch.zeros_like(x) for _ in range(ws)] if rank == 0 else None
    dist.gather(x, out, dst=0)  # every rank's tensor, as a list, on rank 0
    table(rank, "gather(dst=0)", x, out if rank == 0 else "(nothing)",
          lambda r: [t(i) for i in range(ws)] if r == 0 else "(nothing)")

    out = [torch.zeros_like(x) for _ in range(ws)]
    dist.all_gather(out, x)  # ... on every rank
    table(rank, "all_gather", x, out, lambda r: [t(i) for i in range(ws)])

    x = t(rank, rank)
    out = torch.zeros(2 * ws, device=device)
    all_gather_single(out, x)  # the same into one flat tensor
    table(rank, "all_gather_single", x, out, lambda r: t(*[i for i in range(ws) for _ in range(2)]))

    chunks = [t(10 + i) for i in range(ws)] if rank == 0 else None
    out = t(-1)
    dist.scatter(out, chunks, src=0)  # piece i of rank 0's list goes to rank i
    table(rank, "scatter(src=0)", chunks if rank == 0 else "(nothing)", out, lambda r: t(10 + r))

    pieces = [t(10 * rank + j) for j in range(ws)]  # piece j is meant for rank j
    out = t(0)
    dist.reduce_scatter(out, pieces)  # rank j gets the sum of everyone's piece j
    table(rank, "reduce_scatter(SUM)", pieces, out,
          lambda r: t(sum(10 * k + r for k in range(ws))))

    flat = t(*[10 * rank + j for j in range(ws)])
    out = t(0)
    reduce_scatter_single(out, flat)  # the same from one flat tensor
    table(rank, "reduce_scatter_single(SUM)", flat, out, lambda r: t(sum(10 * k + r for k in range(ws))))

    send = [t(10 * rank + j) for j in range(ws)]  # piece j goes to rank j
    recv = [t(-1) for _ in range(ws)]
    if not has_list_all_to_all(backend, ws, timeout):
        if rank == 0:
            print(f"all_to_all  [not supported by gloo in torch {torch.__version__}: not run]")
    else:
        dist.all_to_all(recv, send)  # a transpose: rank j receives piece j from everyone
        table(rank, "all_to_all", send, recv, lambda r: [t(10 * k + r) for k in range(ws)])

    flat_in = t(*[10 * rank + j for j in range(ws)])
    flat_out = torch.zeros(ws, device=device)
    dist.all_to_all_single(flat_out, flat_in)
    table(rank, "all_to_all_single", flat_in, flat_out, lambda r: t(*[10 * k + r for k in range(ws)]))

    dist.barrier()  # nobody passes until everybody has arrived
    table(rank, "barrier", "arrived", "passed", lambda r: "passed")

    objects = [{"epoch": 3, "note": "from rank 0"}] if rank == 0 else [None]
    before = objects[0]
    dist.broadcast_object_list(objects, src=0)  # any picklable object; slower than tensors
    table(rank, "broadcast_object_list(src=0)", before, objects[0], lambda r: {"epoch": 3, "note": "from rank 0"})

    everyone = [None] * ws
    dist.all_gather_object(everyone, f"host-of-{rank}")
    table(rank, "all_gather_object", f"host-of-{rank}", everyone, lambda r: [f"host-of-{i}" for i in range(ws)])

    jobs = [f"job for {i}" for i in range(ws)] if rank == 0 else None
    got = [None]
    dist.scatter_object_list(got, jobs, src=0)  # item i of rank 0's list goes to rank i
    table(rank, "scatter_object_list(src=0)", jobs if rank == 0 else "(nothing)", got[0], lambda r: f"job for {r}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args()
    if "RANK" not in os.environ:
        parser.error("start me with torchrun, e.g. torchrun --standalone --nproc-per-node 4 " + __file__)
    local_rank, local_ws = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    # Gloo on CPU tensors, NCCL on GPU tensors (one per process): the two paths of the course
    device, backend = common.device_and_backend("cpu" if args.backend == "gloo" else "auto", args.backend,
                                                local_rank, local_ws)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout),
                            device_id=device if backend == "nccl" else None)
    try:
        rank, ws = dist.get_rank(), dist.get_world_size()
        if ws < 2:
            parser.error("needs at least 2 processes: --nproc-per-node 2 or more")
        if rank == 0:
            print(f"{ws} ranks, backend {backend}, device {device.type}, torch {torch.__version__}\n")
        run_all(rank, ws, device, backend, timedelta(seconds=args.timeout))
        if rank == 0:
            print(f"\nresult: {'all collectives correct' if not FAILED else 'WRONG: ' + ', '.join(FAILED)}")
        dist.barrier()  # every rank finishes its work before any tears the group down
    finally:
        dist.destroy_process_group()
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
