"""DDP's gradient bucket size (bucket_cap_mb) for ResNet-18 (CIFAR-shaped), with N processes.

DDP groups gradients into buckets and all-reduces a bucket as soon as all its gradients are ready, while
backward is still computing the earlier layers: communication overlaps computation. Small buckets start
sooner but pay the per-message latency many times; one huge bucket (100 MB > ResNet-18's 45 MB of
gradients) waits for the whole backward pass, so nothing overlaps. The variant 'no_sync' skips the
all_reduce altogether (DDP's no_sync()): the compute-only ceiling that shows what communication costs.

Each round runs every variant once, in a rotating order, from the same initial weights.

    torchrun --standalone --nproc-per-node 2 bench/buckets.py            # about 70 s on 2 CPU cores
    torchrun --standalone --nproc-per-node 2 bench/buckets.py --quick    # tiny batch, 1 round
    make bench-buckets
"""

from __future__ import annotations

import contextlib
import gc
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import benchlib
import common
import workarounds
from tools import course


def make_runner(cap_mb: float | None, cfg: dict, device: torch.device, local_rank: int):
    """cap_mb None: the no_sync variant (default buckets, but gradients never leave the process)."""
    g = torch.Generator().manual_seed(dist.get_rank())
    images = torch.randn(cfg["batch"], 3, 32, 32, generator=g).to(device)
    labels = torch.randint(0, 10, (cfg["batch"],), generator=g).to(device)

    def run() -> dict:
        common.seed_everything(0)
        model = DDP(common.resnet18_cifar().to(device), device_ids=[device.index] if device.type == "cuda" else None,
                    bucket_cap_mb=cap_mb if cap_mb is not None else 25)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def step() -> int:
            with model.no_sync() if cap_mb is None else contextlib.nullcontext():
                loss = F.cross_entropy(model(images), labels)
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return cfg["batch"]

        n, seconds = benchlib.time_steps(step, cfg["warmup"], cfg["steps"], device)
        slowest = torch.tensor([seconds], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        logged = model._get_ddp_logging_data()  # the buckets DDP settled on after its first step
        sizes = logged.get("rebuilt_bucket_sizes") if logged.get("has_rebuilt_buckets") else logged.get("bucket_sizes")
        buckets = len(str(sizes).split(",")) if cap_mb and sizes else 0
        gc.collect()
        return {"images_per_s": n * dist.get_world_size() / slowest.item(), "buckets": buckets}

    return run


def main(argv=None):
    parser = benchlib.make_parser(__doc__, "batch 2, 1 timed step, caps 1 and 25 MB, 1 round")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 4 on CPU, 30 on GPU)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (DDP rebuilds its buckets after step 1)")
    parser.add_argument("--batch-size", type=int, default=None, help="per process (default 16 on CPU, 128 on GPU)")
    parser.add_argument("--caps", default="1,5,25,100", help="bucket_cap_mb values, comma-separated")
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        parser.error("start me with torchrun, e.g. torchrun --standalone --nproc-per-node 2 " + __file__)
    try:
        caps = [float(c) for c in args.caps.split(",")]
    except ValueError:
        parser.error(f"--caps must be numbers separated by commas, got {args.caps!r}")
    if any(c <= 0 for c in caps) or not caps:
        parser.error("--caps: every bucket size must be above 0 MB")
    local_rank, procs_per_node = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    try:
        device, backend = common.device_and_backend(local_rank=local_rank, procs_per_node=procs_per_node)
    except RuntimeError as err:
        parser.error(str(err))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        course.share_cpu_threads(procs_per_node)
    cuda = device.type == "cuda"
    if args.quick:
        args.rounds, args.steps, args.warmup, args.batch_size, caps = 1, 1, 2, 2, [1.0, 25.0]
    cfg = {"batch": args.batch_size or (128 if cuda else 16), "steps": args.steps or (30 if cuda else 4),
           "warmup": args.warmup, "caps_mb": caps, "threads": torch.get_num_threads()}
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout),
                            device_id=device if backend == "nccl" else None)
    try:
        rank, ws = dist.get_rank(), dist.get_world_size()
        cfg["world_size"] = ws
        runners = {"no_sync": make_runner(None, cfg, device, local_rank)}
        runners.update({f"{c:g} MB": make_runner(c, cfg, device, local_rank) for c in caps})
        course.print0(rank, f"ResNet-18, {ws} processes, {backend} on {device.type}, batch {cfg['batch']} per process, "
                            f"{cfg['steps']} timed steps, {args.rounds} round(s)")
        per_round = benchlib.run_rounds(runners, args.rounds, say=lambda line: course.print0(rank, line))
        rounds, buckets = benchlib.column(per_round), benchlib.column(per_round, "buckets")[-1]
        if rank == 0:
            report(args, cfg, device, backend, list(runners), rounds, buckets)
        dist.barrier()
    finally:
        workarounds.free_ddp_models()  # workaround: free DDP objects before the group goes, or exit can abort
        dist.destroy_process_group()


def report(args, cfg, device, backend, names, rounds, buckets):
    results = {n: benchlib.summarize([r[n] for r in rounds]) for n in names}
    ratios = {f"{n}_vs_no_sync": {"meaning": f"bucket_cap_mb={n}: images/s vs no communication",
                                  **benchlib.summarize([r[n] / r["no_sync"] for r in rounds])}
              for n in names if n != "no_sync"}
    machine = benchlib.machine_info(device, backend)
    name = benchlib.stem("buckets", device, backend, args.quick)
    payload = {"bench": "buckets", "machine": machine, "config": cfg, "quick": args.quick, "results": results,
               "ratios": ratios, "buckets": buckets, "per_round": rounds}
    md = [f"# DDP bucket size, ResNet-18, {cfg['world_size']} processes ({device.type}, {backend})", "",
          f"{machine['gpu'] or machine['cpu']}, {machine['cores']} cores, torch {torch.__version__}; batch "
          f"{cfg['batch']} per process, {cfg['threads']} thread(s) each; median (min-max) over {args.rounds} round(s).",
          ""]
    md += benchlib.md_table(["bucket_cap_mb", "buckets", "images/s", "vs no communication"],
                            [[n, buckets[n] if n != "no_sync" else "-", benchlib.fmt_range(results[n], 1),
                              "1.00" if n == "no_sync" else
                              f"{ratios[n + '_vs_no_sync']['median']:.2f} ({ratios[n + '_vs_no_sync']['min']:.2f}-"
                              f"{ratios[n + '_vs_no_sync']['max']:.2f})"] for n in names])
    out = Path(args.output_dir)
    paths = benchlib.write_results(out, name, payload, md)
    png = benchlib.bar_plot(out / f"{name}.png", [n if n == "no_sync" else f"cap {n}" for n in names],
                            [results[n] for n in names], "images/s (all processes)",
                            f"ResNet-18 under DDP, {cfg['world_size']} processes, {backend}")
    course.say("\n".join(md))
    course.say("written: " + ", ".join(str(p) for p in paths + ([png] if png else [])))


if __name__ == "__main__":
    main()
