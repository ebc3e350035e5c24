"""Training throughput (images/s) of the course's ConvNet on MNIST-shaped data, variant by variant.

One process, data already on the device ........ plain: the bare forward/backward/step loop
One process, the course's data path ............. course: load_dataset + a DataLoader, as mnist_single.py
One process, torchvision's per-image path ....... torchvision: MNIST + ToTensor + DataLoader, as the seeds
nn.DataParallel on this one device .............. dataparallel (on a CPU or a single GPU it only calls the model)
DDP at world size 1 ............................. ddp_ws1: the cost of the wrapper and its all_reduce alone
DDP at world size 1 on 1/N of the CPU ........... ddp_ws1_perN: one worker's share of the machine, for scaling
DDP with N processes via mp.spawn / torchrun .... spawn_wsN, torchrun_wsN (N = 2, and more where the machine has
                                                  the cores or the GPUs)

Every variant runs once per round, in an order that rotates; the ratios (DDP's overhead, the data path's
cost, speedup and scaling efficiency) are computed inside each round, then summarised as median and range.

    python bench/throughput.py                 # the full set, about 2 minutes on 2 cores
    python bench/throughput.py --quick         # 1 round of a few steps: checks that everything runs
    make bench-throughput
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import timedelta
from itertools import count
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

import benchlib
import common
import workarounds
from tools import course, data

# --------------------------------------------------------------------------- data sources (endless batch iterators)


def resident_batches(train_set, batch: int, device, seed: int, distinct: int = 8):
    """A few batches of the training set, moved to the device once, then served round and round.

    The same images as the course's data path, so that only the path differs, not the data.
    """
    pick = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(seed))[: batch * distinct]
    made = [(train_set.tensors[0][idx].to(device), train_set.tensors[1][idx].to(device))
            for idx in pick.view(distinct, batch)]
    for i in count():
        yield made[i % distinct]


def endless(loader):
    """A DataLoader's batches, epoch after epoch (a new shuffle each epoch)."""
    while True:
        yield from loader


def load_train_set(cfg):
    return common.load_dataset(cfg["dataset"], cfg["data_dir"], train=True)


def torchvision_loader(cfg, device):
    from torchvision import datasets, transforms

    root = Path(cfg["data_dir"]) / data.STANDIN_SUBDIR if cfg["dataset"].endswith("-standin") else cfg["data_dir"]
    to_tensor = transforms.Compose([transforms.ToTensor(),
                                    transforms.Normalize((common.MNIST_MEAN,), (common.MNIST_STD,))])
    train_set = datasets.MNIST(str(root), train=True, transform=to_tensor, download=False)
    return torch.utils.data.DataLoader(train_set, batch_size=cfg["batch_size"], shuffle=True, num_workers=0,
                                       pin_memory=device.type == "cuda")


# --------------------------------------------------------------------------- one measurement


def measure(model: nn.Module, batches, cfg, device) -> tuple[int, float]:
    """(images, seconds) of cfg['steps'] SGD steps after cfg['warmup'] untimed ones."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> int:
        images, labels = next(batches)
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return images.shape[0]

    return benchlib.time_steps(step, cfg["warmup"], cfg["steps"], device)


def new_model(device, seed: int = 0) -> nn.Module:
    common.seed_everything(seed)
    return common.ConvNet().to(device)


# --------------------------------------------------------------------------- DDP with N processes


def ddp_worker(rank: int, ws: int, cfg: dict, out: str, launched_at: float, init_method: str) -> None:
    """One of N processes: join, train cfg['steps'] steps under DDP, rank 0 writes images/s and startup time."""
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local_rank) if cfg["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, cfg["cores"] // ws))  # the same split for both launchers
    dist.init_process_group(cfg["backend"], init_method=init_method, rank=rank, world_size=ws,
                            timeout=timedelta(seconds=cfg["timeout"]),
                            device_id=device if cfg["backend"] == "nccl" else None)
    try:
        model = DDP(new_model(device), device_ids=[device.index] if device.type == "cuda" else None)
        ready = time.time()
        batches = resident_batches(load_train_set(cfg), cfg["batch_size"], device, seed=rank)
        images, seconds = measure(model, batches, cfg, device)
        slowest = torch.tensor([seconds], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank is done
        if rank == 0:
            result = {"images_per_s": images * ws / slowest.item(), "startup_s": ready - launched_at,
                      "threads": torch.get_num_threads()}
            course.atomic_write_bytes(json.dumps(result).encode(), out)
        del model
        dist.barrier()
    finally:
        workarounds.free_ddp_models()  # workaround: free DDP objects before the group goes, or exit can abort
        dist.destroy_process_group()


def spawn_entry(rank, ws, cfg, out, launched_at, port):
    ddp_worker(rank, ws, cfg, out, launched_at, f"tcp://127.0.0.1:{port}")


def run_spawn(ws: int, cfg: dict, tmp: str) -> dict:
    out = os.path.join(tmp, f"spawn_{ws}.json")
    launched_at = time.time()
    ctx = mp.start_processes(spawn_entry, args=(ws, cfg, out, launched_at, common.free_port()), nprocs=ws,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + cfg["timeout"] * 2
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise RuntimeError(f"mp.spawn with {ws} processes took longer than {cfg['timeout'] * 2:.0f} s")
    return json.loads(Path(out).read_text())


def run_torchrun(ws: int, cfg: dict, tmp: str) -> dict:
    out = os.path.join(tmp, f"torchrun_{ws}.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr", "127.0.0.1",
           f"--nproc-per-node={ws}", __file__,
           "--worker-out", out, "--worker-config", json.dumps(cfg), "--launched-at", repr(time.time())]
    benchlib.run_bounded(cmd, timeout=cfg["timeout"] * 2, env={"OMP_NUM_THREADS": "1"})  # no torchrun banner
    return json.loads(Path(out).read_text())


# --------------------------------------------------------------------------- the driver


def plan_world_sizes(device, cores: int, requested: list[int] | None) -> tuple[list[int], str]:
    """World sizes for the multi-process variants, and a note when there are none."""
    if requested is not None:
        sizes = requested
    elif device.type == "cuda":
        gpus = torch.cuda.device_count()
        sizes = [n for n in (2, 4, 8) if n <= gpus]
    else:
        sizes = [n for n in (2, 4, 8) if n <= cores]
    if device.type == "cuda" and any(n > torch.cuda.device_count() for n in sizes):
        raise course.UsageError(f"--world-sizes {sizes}: this machine has {torch.cuda.device_count()} GPU(s)")
    if not sizes:
        return [], (f"only {torch.cuda.device_count()} GPU: the multi-process variants need 2" if device.type == "cuda"
                    else f"only {cores} core: the multi-process variants need 2")
    return sizes, ""


def dataparallel_on(device):
    """nn.DataParallel over this one device, like the other single-process rows (not over every visible GPU).
    On the CPU of a machine whose GPUs are unusable it would take those GPUs, so the plain model stands in."""
    if device.type == "cuda":
        return nn.DataParallel(new_model(device), device_ids=[device.index])
    return new_model(device) if torch.cuda.is_available() else nn.DataParallel(new_model(device))


def build_variants(cfg: dict, device, world_sizes: list[int], tmp: str) -> dict:
    """name -> (label, function returning {'images_per_s': ..., maybe 'startup_s': ...})."""
    cores = cfg["cores"]
    train_set = load_train_set(cfg)
    course_path = DataLoader(train_set, batch_size=cfg["batch_size"], shuffle=True,
                             generator=torch.Generator().manual_seed(0), pin_memory=device.type == "cuda")
    tv = torchvision_loader(cfg, device)

    def single(make_model, batches, threads=cores):
        def run():
            if device.type == "cpu":
                torch.set_num_threads(threads)
            images, seconds = measure(make_model(), batches(), cfg, device)
            return {"images_per_s": images / seconds}
        return run

    def ddp1():
        return DDP(new_model(device), device_ids=[device.index] if device.type == "cuda" else None)

    resident = lambda: resident_batches(train_set, cfg["batch_size"], device, seed=0)  # noqa: E731
    variants = {
        "plain": ("plain loop, data on device", single(lambda: new_model(device), resident)),
        "course": ("course data path", single(lambda: new_model(device), lambda: endless(course_path))),
        "torchvision": ("torchvision per-image loader", single(lambda: new_model(device), lambda: endless(tv))),
        "dataparallel": ("nn.DataParallel, one device", single(lambda: dataparallel_on(device), resident)),
        "ddp_ws1": ("DDP, world size 1", single(ddp1, resident)),
    }
    for n in world_sizes:
        if device.type == "cpu":
            share = max(1, cores // n)
            variants[f"ddp_ws1_per{n}"] = (f"DDP ws 1 on 1/{n} of the cores", single(ddp1, resident, share))
        variants[f"spawn_ws{n}"] = (f"DDP ws {n}, mp.spawn", lambda n=n: run_spawn(n, cfg, tmp))
        variants[f"torchrun_ws{n}"] = (f"DDP ws {n}, torchrun", lambda n=n: run_torchrun(n, cfg, tmp))
    return variants


def ratio_definitions(device, world_sizes: list[int]) -> list[tuple[str, str, callable]]:
    """(key, what it means, f(one round's images/s by variant) -> number)."""
    defs = [("ddp_ws1_overhead", "DDP's overhead at world size 1 (time per image, vs plain)",
             lambda r: r["plain"] / r["ddp_ws1"] - 1),
            ("dataparallel_vs_plain", "nn.DataParallel, images/s vs plain", lambda r: r["dataparallel"] / r["plain"]),
            ("course_vs_resident", "course data path, images/s vs data on device", lambda r: r["course"] / r["plain"]),
            ("torchvision_vs_resident", "torchvision per-image loader, images/s vs data on device",
             lambda r: r["torchvision"] / r["plain"])]
    for n in world_sizes:
        per_worker = f"ddp_ws1_per{n}" if device.type == "cpu" else "ddp_ws1"
        defs += [(f"speedup_ws{n}", f"{n} processes (torchrun) vs one process on the whole machine",
                  lambda r, n=n: r[f"torchrun_ws{n}"] / r["plain"]),
                 (f"efficiency_ws{n}", f"scaling efficiency at {n}: images/s / ({n} x one worker's share alone)",
                  lambda r, n=n, w=per_worker: r[f"torchrun_ws{n}"] / (n * r[w])),
                 (f"spawn_vs_torchrun_ws{n}", f"mp.spawn vs torchrun at {n}, images/s",
                  lambda r, n=n: r[f"spawn_ws{n}"] / r[f"torchrun_ws{n}"])]
    return defs


def world_sizes_arg(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected whole numbers separated by commas, got {text!r}") from None
    if min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"every world size must be at least 1, got {text!r}")
    return sizes


def main(argv=None):
    parser = benchlib.make_parser(__doc__, "1 round, 3 steps per variant")
    parser.add_argument("--steps", type=int, default=150, help="timed steps per variant and round")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before each measurement")
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--world-sizes", type=world_sizes_arg, default=None,
                        help="comma-separated, such as 2,4 (default: 2, 4, 8 as far as cores or GPUs allow)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--dataset", default="mnist-standin", choices=["mnist", "mnist-standin"])
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds for one launch or collective")
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    parser.add_argument("--worker-config", help=argparse.SUPPRESS)
    parser.add_argument("--launched-at", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker_out:  # started by run_torchrun()
        ddp_worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), json.loads(args.worker_config),
                   args.worker_out, args.launched_at, "env://")
        return
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 3, 1
    for name in ("steps", "batch_size"):  # --rounds is checked by its type (benchlib.positive_int)
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    try:
        device, backend = common.device_and_backend(args.device, "auto")
        cores = benchlib.usable_cores()
        world_sizes, note = plan_world_sizes(device, cores, args.world_sizes)
        if args.quick:
            world_sizes = world_sizes[:1]  # a smoke run: the smallest multi-process size is enough
        args.dataset = data.prepare(args.dataset, args.data_dir, quiet=True)
    except (course.UsageError, RuntimeError) as err:
        parser.error(str(err))
    cfg = {"device": device.type, "backend": backend, "cores": cores, "world_sizes": world_sizes,
           "batch_size": args.batch_size,
           "steps": args.steps, "warmup": args.warmup, "timeout": args.timeout, "dataset": args.dataset,
           "data_dir": str(Path(args.data_dir).resolve())}

    # DDP at world size 1 needs a process group in this process; the launched variants make their own
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{common.free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=args.timeout), device_id=device if backend == "nccl" else None)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-throughput-") as tmp:
            variants = build_variants(cfg, device, world_sizes, tmp)
            course.say(f"ConvNet, batch {args.batch_size} per process, {args.steps} timed steps per variant, "
                       f"{args.rounds} round(s), {device.type} ({benchlib.cpu_model()}, {cores} cores)"
                       + (f"; {note}" if note else ""))
            per_round = benchlib.run_rounds({n: fn for n, (_, fn) in variants.items()}, args.rounds)
        torch.set_num_threads(cores)
    finally:
        workarounds.free_ddp_models()  # workaround: free DDP objects before the group goes, or exit can abort
        dist.destroy_process_group()
    report(args, cfg, device, backend, variants, per_round, world_sizes, note)


def report(args, cfg, device, backend, variants, per_round, world_sizes, note):
    names = list(variants)
    rounds = benchlib.column(per_round)
    startups = {n: [r[n] for r in benchlib.column(per_round, "startup_s")] for n in names
                if "startup_s" in per_round[0][n]}
    results = {n: benchlib.summarize([r[n] for r in rounds]) for n in names}
    ratios = {key: {"meaning": meaning, **benchlib.summarize([f(r) for r in rounds])}
              for key, meaning, f in ratio_definitions(device, world_sizes)}
    startup = {n: benchlib.summarize(v) for n, v in startups.items()}
    name = benchlib.stem("throughput", device, backend, args.quick)
    payload = {"bench": "throughput", "machine": benchlib.machine_info(device, backend), "config": cfg,
               "quick": args.quick, "note": note, "labels": {n: variants[n][0] for n in names},
               "results": results, "ratios": ratios, "startup_s": startup, "per_round": rounds}
    md = [f"# Training throughput, ConvNet on MNIST-shaped data ({device.type}, {backend})", "",
          f"{payload['machine']['cpu']}, {cfg['cores']} cores"
          + (f", {payload['machine']['gpu']}" if device.type == "cuda" else "")
          + f"; torch {torch.__version__}; batch {cfg['batch_size']} per process; {cfg['steps']} timed steps; "
          f"median (min-max) over {args.rounds} round(s)." + (f" Note: {note}." if note else ""), ""]
    md += benchlib.md_table(["variant", "images/s", "vs plain"],
                            [[variants[n][0], benchlib.fmt_range(results[n]),
                              f"{results[n]['median'] / results['plain']['median']:.2f}x"] for n in names])
    md += ["", "Ratios, each computed inside a round:", ""]
    md += benchlib.md_table(["ratio", "median (range)"],
                            [[r["meaning"], benchlib.fmt_range(r, pct=True) if k.endswith("overhead")
                              else f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})"] for k, r in ratios.items()])
    if startup:
        md += ["", "Seconds from launch to the first step (imports, process group, model):", ""]
        md += benchlib.md_table(["launcher", "seconds"], [[variants[n][0], benchlib.fmt_range(s, 1)]
                                                        for n, s in startup.items()])
    out = Path(args.output_dir)
    paths = benchlib.write_results(out, name, payload, md)
    png = benchlib.bar_plot(out / f"{name}.png", [variants[n][0] for n in names], [results[n] for n in names],
                            "images/s (all processes)", f"ConvNet training throughput, {device.type}, {backend}")
    course.say("\n".join(md))
    course.say("written: " + ", ".join(str(p) for p in paths + ([png] if png else [])))


if __name__ == "__main__":
    main()
