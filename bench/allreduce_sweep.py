"""Collective bandwidth on this machine: all_reduce, all_gather, reduce_scatter, broadcast from 4 KB to 256 MB,
and an all_reduce built by hand from point-to-point sends around a ring, for the same bytes.

Reports latency, algorithm bandwidth (bytes / time) and bus bandwidth with nccl-tests' definitions
(all_reduce: algbw x 2(n-1)/n; all_gather, reduce_scatter: algbw x (n-1)/n; broadcast: algbw), next
to a local limit: the memory copy bandwidth of one process. Sizes and ops are interleaved within
each round, so machine noise hits all of them alike; the medians over rounds are reported, and the
ring's time relative to all_reduce's is computed inside each round.

    torchrun --standalone --nproc-per-node 2 bench/allreduce_sweep.py            # 4 KB .. 256 MB, about a minute
    torchrun --standalone --nproc-per-node 2 bench/allreduce_sweep.py --quick    # 4 KB .. 4 MB, seconds
    make bench-allreduce
"""

import os
import statistics
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import benchlib
import common
from tools import course

# torch 2.13's names; torch 2.11 has only the older all_gather_into_tensor and reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0,
              "ring_p2p": lambda n: 2 * (n - 1) / n}  # the same work as all_reduce


def ring_all_reduce(chunks: list[torch.Tensor], rank: int, ws: int, scratch: torch.Tensor) -> None:
    """Sum a tensor over all ranks in place with isend/irecv only; `chunks` are its ws equal views.

    Phase 1 (reduce-scatter): in step s, send chunk (rank - s) to the right neighbour, receive chunk
    (rank - s - 1) from the left one and add it in. After ws - 1 steps this rank holds the full sum of
    chunk (rank + 1). Phase 2 (all-gather): pass the finished chunks around the ring once more.
    Each rank sends 2 (ws - 1) / ws of the tensor: the minimum that any all_reduce needs.
    """
    right, left = (rank + 1) % ws, (rank - 1) % ws
    for step in range(ws - 1):
        ops = [dist.P2POp(dist.isend, chunks[(rank - step) % ws], right), dist.P2POp(dist.irecv, scratch, left)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        chunks[(rank - step - 1) % ws].add_(scratch)
    for step in range(ws - 1):
        ops = [dist.P2POp(dist.isend, chunks[(rank + 1 - step) % ws], right),
               dist.P2POp(dist.irecv, chunks[(rank - step) % ws], left)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()


def check_ring(ws: int, device) -> None:
    """The hand-made ring must give what all_reduce gives (integers in float32: exact)."""
    rank = dist.get_rank()
    data = torch.arange(12 * ws, dtype=torch.float32, device=device) * (rank + 1)
    expected = data.clone()
    dist.all_reduce(expected)
    ring_all_reduce(list(data.chunk(ws)), rank, ws, torch.empty(12, device=device))
    if not torch.equal(data, expected):
        raise RuntimeError(f"rank {rank}: the p2p ring all_reduce disagrees with dist.all_reduce")


def timed(fn, iters, device):
    """Seconds per call of fn. On CUDA, collectives only enqueue work on a stream: synchronise before
    reading the clock, or the time measured is the launch, not the transfer."""
    fn()  # warm up this size
    benchlib.sync(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    benchlib.sync(device)
    return (time.perf_counter() - start) / iters


def op_runner(name, nbytes, ws, device):
    n = nbytes // 4  # float32 elements
    if name == "all_reduce":
        t = torch.ones(n, device=device)
        return lambda: dist.all_reduce(t)
    if name == "broadcast":
        t = torch.ones(n, device=device)
        return lambda: dist.broadcast(t, src=0)
    if name == "ring_p2p":
        t = torch.ones(n - n % ws, device=device)
        chunks, scratch = list(t.chunk(ws)), torch.empty((n - n % ws) // ws, device=device)
        return lambda: ring_all_reduce(chunks, dist.get_rank(), ws, scratch)
    if name == "all_gather":  # nbytes is the output size, as nccl-tests counts it
        out, part = torch.empty(n - n % ws, device=device), torch.ones((n - n % ws) // ws, device=device)
        return lambda: all_gather_single(out, part)
    out, full = torch.empty((n - n % ws) // ws, device=device), torch.ones(n - n % ws, device=device)
    return lambda: reduce_scatter_single(out, full)  # nbytes is the input size


def memcpy_gbps(nbytes, device):
    src, dst = torch.ones(nbytes // 4, device=device), torch.empty(nbytes // 4, device=device)
    dst.copy_(src)
    benchlib.sync(device)
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    benchlib.sync(device)  # a CUDA copy is asynchronous: wait for it
    return nbytes * 5 / (time.perf_counter() - start) / 1e9


def main():
    parser = benchlib.make_parser(__doc__, "4 KB .. 4 MB, 2 rounds")
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()
    if args.quick:
        args.rounds = 2
    if "RANK" not in os.environ:
        parser.error("start me with torchrun, e.g. torchrun --standalone --nproc-per-node 2 " + __file__)
    local_rank, procs_per_node = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    try:
        device, backend = common.device_and_backend(local_rank=local_rank, procs_per_node=procs_per_node)
    except RuntimeError as err:
        parser.error(str(err))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout),
                            device_id=device if backend == "nccl" else None)
    try:
        rank, ws = dist.get_rank(), dist.get_world_size()
        check_ring(ws, device)
        top = 22 if args.quick else 28  # 4 MB or 256 MB
        sizes = [2 ** k for k in range(12, top + 1, 2)]
        rounds = args.rounds
        times = {(op, s): [] for op in BUS_FACTOR for s in sizes}
        copies = []
        for r in range(rounds):
            for s in sizes:
                iters = max(2, min(10 if args.quick else 200, (256 << 20) // s))  # ~0.1-0.5 s per op and size
                for op in benchlib.rotated(list(BUS_FACTOR), r):  # every op at this size, then the next size
                    times[op, s].append(timed(op_runner(op, s, ws, device), iters, device))
            if rank == 0:  # the local limit, measured in every round too, while the other ranks wait
                copies.append(memcpy_gbps(sizes[-1], device))
            dist.barrier()
            course.print0(rank, f"round {r + 1}/{rounds} done")
        limit = statistics.median(copies) if rank == 0 else 0.0
        rows = []
        for op in BUS_FACTOR:
            for s in sizes:
                med = statistics.median(times[op, s])
                spread = (max(times[op, s]) - min(times[op, s])) / med if med else 0.0
                algbw = s / med / 1e9
                rows.append({"op": op, "bytes": s, "latency_us": med * 1e6, "spread": spread,
                             "algbw_GBps": algbw, "busbw_GBps": algbw * BUS_FACTOR[op](ws)})
        # the ring's time / all_reduce's time, per size, computed inside each round
        ring = [{"bytes": s, **benchlib.summarize([a / b for a, b in zip(times["ring_p2p", s],
                                                                          times["all_reduce", s], strict=True)])}
                for s in sizes]
        if rank == 0:
            report(rows, ring, ws, backend, device, limit, args)
        dist.barrier()  # every rank finishes its work before any tears the group down
    finally:
        dist.destroy_process_group()


def size_label(nbytes: int) -> str:
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"


def report(rows, ring, ws, backend, device, limit, args):
    machine = {**benchlib.machine_info(device, backend), "world_size": ws}
    lines = [f"# Collective bandwidth, {ws} processes ({device.type}, {backend})", "",
             f"{machine['gpu'] or machine['cpu']}, {machine['cores']} cores, torch {torch.__version__}; "
             f"medians over {args.rounds} rounds; memory copy of one process: "
             f"{limit:.1f} GB/s (the local limit). ring_p2p is all_reduce made of isend/irecv around a ring.", ""]
    lines += benchlib.md_table(["op", "size", "latency", "algbw GB/s", "busbw GB/s", "spread"],
                               [[r["op"], size_label(r["bytes"]), f"{r['latency_us']:.0f} us", f"{r['algbw_GBps']:.3f}",
                                 f"{r['busbw_GBps']:.3f}", f"{r['spread']:.0%}"] for r in rows])
    lines += ["", "Point-to-point ring vs dist.all_reduce, the same bytes: time ratio (above 1: the ring is slower)",
              ""]
    lines += benchlib.md_table(["size", "ring time / all_reduce time"],
                               [[size_label(r["bytes"]), f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})"]
                                for r in ring])
    text = "\n".join(lines)
    course.say(text)
    name = benchlib.stem("allreduce_sweep", device, backend, args.quick)
    out = Path(args.output_dir)
    paths = benchlib.write_results(out, name, {"bench": "allreduce_sweep", "machine": machine, "quick": args.quick,
                                               "memcpy_GBps": limit, "rows": rows, "ring_vs_all_reduce": ring},
                                   lines)
    plt = benchlib.pyplot(out / f"{name}.png")
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for op in BUS_FACTOR:
            pts = [r for r in rows if r["op"] == op]
            ax.plot([r["bytes"] for r in pts], [r["busbw_GBps"] for r in pts], marker="o", label=op,
                    linestyle=":" if op == "ring_p2p" else "-")
        ax.axhline(limit, color="gray", linestyle="--", label=f"memcpy, 1 process ({limit:.1f} GB/s)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.set_title(f"{backend} on {device.type}, {ws} processes")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=100)
        plt.close(fig)
        paths.append(out / f"{name}.png")
    course.say("written: " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
