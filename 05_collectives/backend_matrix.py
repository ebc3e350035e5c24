"""Measure which operations of the backend table work here, with which dtypes.

Every operation of the table runs in a fresh process group (a failure cannot leave the next
test out of step), its result is checked, and the ranks agree on the mark. The table is printed
in the layout of the usual backend table, next to what that static table claims.

    torchrun --standalone --nproc-per-node 2 05_collectives/backend_matrix.py
    torchrun --standalone --nproc-per-node 2 05_collectives/backend_matrix.py --output-dir bench/results
    make backend-matrix
"""

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import common

DTYPES = (torch.float32, torch.float16, torch.int64)
# what the commonly copied static table says for Gloo on CPU and NCCL on GPU (✓ / ✘)
_OPS = ("send/recv", "broadcast", "all_reduce", "reduce", "all_gather", "gather", "scatter", "reduce_scatter",
        "all_to_all", "barrier")
STATIC = {("gloo", "cpu"): dict(zip(_OPS, "✓✓✓✓✓✓✓✘✘✓", strict=True)),
          ("nccl", "cuda"): dict(zip(_OPS, "✓✓✓✓✓✓✓✓✓✓", strict=True))}


def ops(rank, ws, dtype, device, group):
    """name -> a function that runs the op in `group` and returns True when the result is right."""
    def t(values):
        return torch.tensor(values, device=device).to(dtype)

    def send_recv():
        x = t([rank + 1])
        if rank == 0:
            dist.send(x, dst=1, group=group)
        elif rank == 1:
            dist.recv(x, src=0, group=group)
        return rank != 1 or x.item() == 1

    def broadcast():
        x = t([rank + 1])
        dist.broadcast(x, src=0, group=group)
        return x.item() == 1

    def all_reduce(op=dist.ReduceOp.SUM, expect=ws * (ws + 1) // 2):
        x = t([rank + 1])
        dist.all_reduce(x, op=op, group=group)
        return x.item() == expect

    def reduce():
        x = t([rank + 1])
        dist.reduce(x, dst=0, group=group)
        return rank != 0 or x.item() == ws * (ws + 1) // 2

    def all_gather(uneven=False):
        x = t([rank] * (rank + 1 if uneven else 1))
        out = [t([0] * (i + 1 if uneven else 1)) for i in range(ws)]
        dist.all_gather(out, x, group=group)
        return [o[0].item() for o in out] == list(range(ws))

    def gather():
        out = [t([0]) for _ in range(ws)] if rank == 0 else None
        dist.gather(t([rank]), out, dst=0, group=group)
        return rank != 0 or [o.item() for o in out] == list(range(ws))

    def scatter():
        out = t([-1])
        dist.scatter(out, [t([i]) for i in range(ws)] if rank == 0 else None, src=0, group=group)
        return out.item() == rank

    def reduce_scatter():
        out = t([0])
        dist.reduce_scatter(out, [t([j]) for j in range(ws)], group=group)
        return out.item() == ws * rank

    def all_to_all():
        out = [t([-1]) for _ in range(ws)]
        dist.all_to_all(out, [t([10 * rank + j]) for j in range(ws)], group=group)
        return [o.item() for o in out] == [10 * k + rank for k in range(ws)]

    def barrier():
        dist.barrier(group=group)
        return True

    return {"send/recv": send_recv, "broadcast": broadcast, "all_reduce": all_reduce, "reduce": reduce,
            "all_gather": all_gather, "gather": gather, "scatter": scatter, "reduce_scatter": reduce_scatter,
            "all_to_all": all_to_all, "barrier": barrier,
            "all_reduce AVG": lambda: all_reduce(dist.ReduceOp.AVG, (ws + 1) / 2),
            "all_reduce BAND": lambda: all_reduce(dist.ReduceOp.BAND, 0 if ws > 1 else 1),
            "all_gather, uneven sizes": lambda: all_gather(uneven=True)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    parser.add_argument("--output-dir", help="also write the table to DIR/backend_matrix_<backend>_<device>_<date>.md")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per operation")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        parser.error("start me with torchrun, e.g. torchrun --standalone --nproc-per-node 2 " + __file__)
    local_rank, local_ws = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    # Gloo on CPU tensors, NCCL on GPU tensors (one per process): the two columns of the usual table
    device, backend = common.device_and_backend("cpu" if args.backend == "gloo" else "auto", args.backend,
                                                local_rank, local_ws)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout),
                            device_id=device if backend == "nccl" else None)
    try:
        rank, ws = dist.get_rank(), dist.get_world_size()
        if rank == 0:
            print(f"{ws} ranks, backend {backend}, device {device.type}, torch {torch.__version__}\n")
        names = list(ops(rank, ws, torch.float32, device, None))
        marks = {}
        for name in names:
            for dtype in DTYPES:
                group = dist.new_group(backend=backend, timeout=timedelta(seconds=args.timeout))  # fresh
                try:
                    ok = bool(ops(rank, ws, dtype, device, group)[name]())
                except Exception:  # noqa: BLE001 - an unsupported op or dtype is what we measure
                    ok = False
                flag = torch.tensor([float(ok)], device=device)
                dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # on the default group: all ranks agree
                marks[name, dtype] = "✓" if flag.item() == 1 else "✘"
                dist.destroy_process_group(group)
        if rank == 0:
            head = f"{backend} {device.type.upper()}"
            lines = [f"Measured with torch {torch.__version__}, {ws} processes, backend {backend} on {device.type}.",
                     "", f"| operation | {' | '.join(str(d).replace('torch.', '') for d in DTYPES)} | "
                     f"static table ({head}) |",
                     "|---|" + ":---:|" * (len(DTYPES) + 1)]
            for name in names:
                claim = STATIC.get((backend, device.type), {}).get(name, "-")
                lines.append(f"| {name} | {' | '.join(marks[name, d] for d in DTYPES)} | {claim} |")
            text = "\n".join(lines)
            print(text)
            if args.output_dir:
                path = os.path.join(args.output_dir, f"backend_matrix_{backend}_{device.type}_"
                                                     f"{time.strftime('%Y-%m-%d')}.md")
                os.makedirs(args.output_dir, exist_ok=True)
                with open(path, "w", encoding="utf-8") as f:
                    f.write(text + "\n")
                print(f"\nwritten to {path}")
        dist.barrier()  # every rank finishes its work before any tears the group down
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
