"""Collective bandwidth on this machine: all_reduce, all_gather, reduce_scatter, broadcast from 4 KB to 256 MB.

Reports latency, algorithm bandwidth (bytes / time) and bus bandwidth with nccl-tests' definitions
(all_reduce: algbw x 2(n-1)/n; all_gather, reduce_scatter: algbw x (n-1)/n; broadcast: algbw), next
to a local limit: the memory copy bandwidth of one process. Sizes and ops are interleaved within
each round, so machine noise hits all of them alike; the medians over rounds are reported.

    torchrun --standalone --nproc-per-node 2 bench/allreduce_sweep.py            # 4 KB .. 256 MB
    torchrun --standalone --nproc-per-node 2 bench/allreduce_sweep.py --quick    # 4 KB .. 4 MB, seconds
    make bench-allreduce
"""

import argparse
import json
import os
import platform
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import common

BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0}


def timed(fn, iters):
    fn()  # warm up this size
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def op_runner(name, nbytes, ws, device):
    n = nbytes // 4  # float32 elements
    if name == "all_reduce":
        t = torch.ones(n, device=device)
        return lambda: dist.all_reduce(t)
    if name == "broadcast":
        t = torch.ones(n, device=device)
        return lambda: dist.broadcast(t, src=0)
    if name == "all_gather":  # nbytes is the output size, as nccl-tests counts it
        out, part = torch.empty(n - n % ws, device=device), torch.ones((n - n % ws) // ws, device=device)
        return lambda: dist.all_gather_single(out, part)
    out, full = torch.empty((n - n % ws) // ws, device=device), torch.ones(n - n % ws, device=device)
    return lambda: dist.reduce_scatter_single(out, full)  # nbytes is the input size


def memcpy_gbps(nbytes, device):
    src, dst = torch.ones(nbytes // 4, device=device), torch.empty(nbytes // 4, device=device)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    return nbytes * 5 / (time.perf_counter() - start) / 1e9


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 KB .. 4 MB, 2 rounds: a smoke run")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output-dir", default="bench/results")
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()
    if "RANK" not in os.environ:
        parser.error("start me with torchrun, e.g. torchrun --standalone --nproc-per-node 2 " + __file__)
    local_rank = int(os.environ["LOCAL_RANK"])
    try:
        device, backend = common.choose_device_backend("auto", "auto", int(os.environ["LOCAL_WORLD_SIZE"]))
    except common.UsageError as err:
        parser.error(str(err))
    device = torch.device("cuda", local_rank) if device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
    try:
        rank, ws = dist.get_rank(), dist.get_world_size()
        top = 22 if args.quick else 28  # 4 MB or 256 MB
        sizes = [2 ** k for k in range(12, top + 1, 2)]
        rounds = 2 if args.quick else args.rounds
        times = {(op, s): [] for op in BUS_FACTOR for s in sizes}
        for r in range(rounds):
            for s in sizes:
                iters = max(2, min(50, (64 << 20) // s))
                for op in BUS_FACTOR:  # interleaved: every op at this size, then the next size
                    times[op, s].append(timed(op_runner(op, s, ws, device), iters))
            common.print0(rank, f"round {r + 1}/{rounds} done")
        limit = memcpy_gbps(min(sizes[-1], 256 << 20), device)
        rows = []
        for op in BUS_FACTOR:
            for s in sizes:
                med = statistics.median(times[op, s])
                spread = (max(times[op, s]) - min(times[op, s])) / med if med else 0.0
                algbw = s / med / 1e9
                rows.append({"op": op, "bytes": s, "latency_us": med * 1e6, "spread": spread,
                             "algbw_GBps": algbw, "busbw_GBps": algbw * BUS_FACTOR[op](ws)})
        if rank == 0:
            report(rows, ws, backend, device, limit, args)
        dist.barrier()  # every rank finishes its work before any tears the group down
    finally:
        dist.destroy_process_group()


def report(rows, ws, backend, device, limit, args):
    machine = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
               "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None,
               "torch": torch.__version__, "backend": backend, "world_size": ws}
    lines = [f"{ws} processes, {backend} on {device.type}, torch {torch.__version__}; "
             f"memory copy of one process: {limit:.1f} GB/s (the local limit)", "",
             "| op | size | latency | algbw GB/s | busbw GB/s | spread |", "|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        size = f"{row['bytes'] >> 20} MB" if row["bytes"] >= 1 << 20 else f"{row['bytes'] >> 10} KB"
        lines.append(f"| {row['op']} | {size} | {row['latency_us']:.0f} us | {row['algbw_GBps']:.3f} | "
                     f"{row['busbw_GBps']:.3f} | {row['spread']:.0%} |")
    text = "\n".join(lines)
    common.say(text)
    tag = f"allreduce_sweep_{backend}_{device.type}{'_quick' if args.quick else ''}_{time.strftime('%Y-%m-%d')}"
    os.makedirs(args.output_dir, exist_ok=True)
    common.atomic_write_bytes((text + "\n").encode(), os.path.join(args.output_dir, tag + ".md"))
    common.atomic_write_bytes(json.dumps({"machine": machine, "memcpy_GBps": limit, "rows": rows},
                                         indent=1).encode(), os.path.join(args.output_dir, tag + ".json"))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    plt.figure(figsize=(6.5, 4))
    for op in BUS_FACTOR:
        pts = [r for r in rows if r["op"] == op]
        plt.plot([r["bytes"] for r in pts], [r["busbw_GBps"] for r in pts], marker="o", label=op)
    plt.axhline(limit, color="gray", linestyle="--", label=f"memcpy, 1 process ({limit:.1f} GB/s)")
    plt.xscale("log", base=2)
    plt.yscale("log")
    plt.xlabel("message size (bytes)")
    plt.ylabel("bus bandwidth (GB/s)")
    plt.title(f"{backend} on {device.type}, {ws} processes")
    plt.legend(fontsize=8)
    plt.tight_layout()
    plt.savefig(os.path.join(args.output_dir, tag + ".png"), dpi=100)
    common.say(f"written: {args.output_dir}/{tag}.md, .json, .png")


if __name__ == "__main__":
    main()
    common.leave()  # skip the interpreter teardown that can abort (see common.leave)
