"""See DDP overlap gradient all-reduce with backward: a per-rank timeline of a few training steps.

    python 02_ddp_spawn/ddp_timeline.py --nproc 2                     # ResNet-18 and ConvNet, three variants
    python 02_ddp_spawn/ddp_timeline.py --nproc 2 --models resnet18   # one model
    make ddp-timeline NPROC=2

Every rank trains a few steps under torch.profiler. A timed copy of DDP's own all-reduce hook notes when each
gradient bucket's all-reduce starts (the bucket is ready) and ends; a hook on every parameter notes when its
gradient is computed, so backward's compute ends with the last one. Three variants of each model:

    default     DDP's default buckets (25 MB): buckets all-reduce while backward still runs
    one-bucket  bucket_cap_mb=10000: one bucket, ready only when the last gradient is, so nothing overlaps
    no-sync     4 micro-batches, the first 3 inside model.no_sync(): no communication until the last backward

Written to --output-dir (default runs/timeline): timeline_<model>.png (per rank a compute lane and an all-reduce
lane, the variants side by side, the share of all-reduce time hidden under backward in each title),
timeline.json/.md (the numbers), and traces/<model>_<variant>_rank<r>.json, the profiler's Chrome trace with the
hook's buckets added as their own lane (open it in https://ui.perfetto.dev or chrome://tracing).

All times are taken on the host. On the CPU that is when the work ran; on CUDA it is only when the work was
queued (an NCCL all-reduce counts as done once it is queued on its stream), so there the script reports the step
times (each step ends with a synchronize) and says the all-reduce and overlap figures are not measured: the trace's
GPU lanes show the kernels, the NCCL ones on their own stream. A small model such as the ConvNet fits in one
bucket: there is nothing to overlap, and its default and one-bucket timelines look alike.
"""

import contextlib
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function

import common
import workarounds
from tools import course

VARIANTS = {"default": {}, "one-bucket": {"bucket_cap_mb": 10_000}, "no-sync": {}}
MICRO_BATCHES = 4  # no-sync: micro-batches per optimizer step
LANE = 10_000_000  # the trace's thread id of the added lane


class Clock:
    """What one rank notes during one step: compute phases, parameter gradients and all-reduced buckets."""

    def __init__(self):
        self.phases, self.grads, self.buckets = [], [], []

    def phase(self, name, start):
        self.phases.append((name, start, time.perf_counter()))


def timed_allreduce(clock, bucket):
    """DDP's default all-reduce hook (average the bucket over the ranks), with its start and end noted."""
    start = time.perf_counter()
    nbytes = bucket.buffer().numel() * bucket.buffer().element_size()

    def done(fut):
        clock.buckets.append((bucket.index(), start, time.perf_counter(), nbytes))
        return fut.value()

    return default_hooks.allreduce_hook(None, bucket).then(done)


def build(model_name, variant, device):
    torch.manual_seed(0)
    net = common.resnet18_cifar() if model_name == "resnet18" else common.ConvNet()
    net = net.to(device)
    model = DDP(net, device_ids=[device.index] if device.type == "cuda" else None, **VARIANTS[variant])
    clock = Clock()
    model.register_comm_hook(clock, timed_allreduce)
    for p in net.parameters():  # runs when the parameter's gradient has been computed, before DDP sees it
        p.register_hook(lambda grad: clock.grads.append(time.perf_counter()))
    return model, clock


def one_step(model, optimizer, clock, batches, variant):
    """Forward and backward for each micro-batch (one, unless no-sync), then the optimizer step."""
    optimizer.zero_grad(set_to_none=True)
    for i, (x, y) in enumerate(batches):
        last = i == len(batches) - 1
        sync = model.no_sync() if variant == "no-sync" and not last else contextlib.nullcontext()
        with sync:
            start = time.perf_counter()
            loss = F.cross_entropy(model(x), y)
            clock.phase("forward", start)
            start, clock.grads = time.perf_counter(), []
            loss.backward()  # with DDP: the buckets' all-reduces are started inside, and waited for at its end
            clock.phase("backward", start)
            clock.phases[-1] += (max(clock.grads),)  # the backward phase also records when compute ended
    start = time.perf_counter()
    optimizer.step()
    clock.phase("optimizer", start)


def measure(model_name, variant, args, device, rank, trace_path):
    model, clock = build(model_name, variant, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    shape = (3, 32, 32) if model_name == "resnet18" else (1, 28, 28)
    gen = torch.Generator().manual_seed(rank)
    micro = MICRO_BATCHES if variant == "no-sync" else 1
    batches = [(torch.randn(args.batch_size, *shape, generator=gen).to(device),
                torch.randint(0, 10, (args.batch_size,), generator=gen).to(device)) for _ in range(micro)]
    for _ in range(args.warmup):  # DDP rebuilds its buckets after the first step, in the order gradients came
        one_step(model, optimizer, clock, batches, variant)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    steps, marks = [], []
    with profile(activities=activities) as prof:
        for step in range(args.steps):
            clock.phases, clock.buckets = [], []
            _sync(device)
            with record_function(f"timeline step {step}"):
                marks.append(time.perf_counter())
                one_step(model, optimizer, clock, batches, variant)
                _sync(device)
            steps.append({"phases": clock.phases, "buckets": sorted(clock.buckets, key=lambda b: b[1])})
    prof.export_chrome_trace(str(trace_path))
    add_lane(trace_path, steps, marks)
    return steps


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def add_lane(trace_path, steps, marks):
    """Put the hook's buckets and the compute phases into the profiler's trace, on the profiler's clock."""
    trace = json.loads(Path(trace_path).read_text())
    events = trace["traceEvents"]
    starts = step_marks(events)
    pid = starts["timeline step 0"]["pid"]
    added = [{"ph": "M", "name": "thread_name", "pid": pid, "tid": LANE,
              "args": {"name": "DDP timeline (compute phases, all-reduced buckets)"}}]
    for i, (step, mark) in enumerate(zip(steps, marks, strict=True)):
        offset = starts[f"timeline step {i}"]["ts"] - mark * 1e6  # profiler microseconds - our seconds
        for name, start, end, *compute_end in step["phases"]:
            added.append(_event(f"{name} (step {i})", start, end, offset, pid, "compute"))
            if compute_end:
                added.append(_event(f"backward compute (step {i})", start, compute_end[0], offset, pid, "compute"))
        for index, start, end, nbytes in step["buckets"]:
            added.append(_event(f"all-reduce bucket {index} (step {i})", start, end, offset, pid, "allreduce",
                                bytes=nbytes))
    trace["traceEvents"] = events + added
    course.atomic_write_bytes(json.dumps(trace).encode(), trace_path)


def step_marks(events) -> dict:
    """The "timeline step N" ranges as the host recorded them, by name. On CUDA the profiler also writes a GPU-side
    copy of every record_function range (category gpu_user_annotation, on the GPU's own lane and clock); our
    marks are host times, so only the CPU-side one (user_annotation) gives the offset."""
    return {e["name"]: e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
            and e.get("name", "").startswith("timeline step ")}


def _event(name, start, end, offset, pid, cat, **extra):
    return {"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": LANE, "ts": start * 1e6 + offset,
            "dur": (end - start) * 1e6, "args": extra}


def summarize(steps):
    """Per step: total all-reduce time, the part of it hidden under backward's compute, what backward waited."""
    rows = []
    for step in steps:
        backward = [p for p in step["phases"] if p[0] == "backward"][-1]  # the one that communicates
        _, b_start, b_end, compute_end = backward
        comm = sum(end - start for _, start, end, _ in step["buckets"])
        hidden = sum(max(0.0, min(end, compute_end) - max(start, b_start)) for _, start, end, _ in step["buckets"])
        rows.append({"step_s": step["phases"][-1][2] - step["phases"][0][1], "allreduce_s": comm,
                     "hidden_share": hidden / comm if comm else 0.0, "backward_wait_s": b_end - compute_end,
                     "buckets": len(step["buckets"]),
                     "first_start_before_compute_end": bool(step["buckets"])
                     and step["buckets"][0][1] < compute_end})
    return rows


def worker(rank, world_size, args):
    workarounds.stop_with_launcher()  # workaround: a killed launcher takes this worker with it
    device, backend = course.choose_device(args.device, args.backend, local_rank=rank, procs_per_node=world_size)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        course.share_cpu_threads(world_size)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=args.timeout),
                            device_id=device if backend == "nccl" else None)
    try:
        results = {}
        for model_name in args.models:
            for variant in VARIANTS:
                trace = Path(args.trace_dir) / f"{model_name}_{variant}_rank{rank}.json"
                steps = measure(model_name, variant, args, device, rank, trace)
                every = [None] * world_size
                dist.all_gather_object(every, steps)  # rank 0 draws every rank's lanes
                results[(model_name, variant)] = every
                course.print0(rank, f"{model_name:8s} {variant:10s} " + describe(every, device.type))
        if rank == 0:
            report(args, results, device, backend, world_size)
        dist.barrier()
    finally:
        workarounds.free_ddp_models()  # workaround: free DDP objects before the group goes, or exit can abort
        dist.destroy_process_group()


HOST_ONLY = ("allreduce_s", "hidden_share", "backward_wait_s", "first_start_before_compute_end_every_step")


def medians(every, device_type: str = "cpu") -> dict:
    """Medians over every rank's steps. On CUDA the host saw only when work was queued: the figures that need
    when an all-reduce ran (HOST_ONLY) are None there, not measured."""
    rows = [r for steps in every for r in summarize(steps)]
    med = {k: statistics.median(r[k] for r in rows) for k in ("step_s", "allreduce_s", "hidden_share",
                                                               "backward_wait_s")}
    med["buckets"] = rows[0]["buckets"]
    med["first_start_before_compute_end_every_step"] = all(r["first_start_before_compute_end"] for r in rows)
    if device_type == "cuda":
        med.update(dict.fromkeys(HOST_ONLY))
    return med


def describe(every, device_type: str = "cpu"):
    med = medians(every, device_type)
    if med["hidden_share"] is None:
        return (f"step {med['step_s'] * 1e3:7.1f} ms, {med['buckets']} bucket(s); all-reduce time and overlap not "
                f"measured on CUDA (the host sees when work is queued, not when it runs: read the trace's GPU lanes)")
    return (f"step {med['step_s'] * 1e3:7.1f} ms, {med['buckets']} bucket(s), all-reduce "
            f"{med['allreduce_s'] * 1e3:6.1f} ms of which {med['hidden_share']:4.0%} hidden under backward, "
            f"backward waited {med['backward_wait_s'] * 1e3:5.1f} ms after compute")


def report(args, results, device, backend, world_size):
    out = Path(args.output_dir)  # main made it before the workers started
    summary = {"config": {"world_size": world_size, "device": device.type, "backend": backend,
                          "batch_size": args.batch_size, "steps": args.steps, "warmup": args.warmup,
                          "micro_batches_no_sync": MICRO_BATCHES, "torch": torch.__version__},
               "results": {}}
    lines = [f"# DDP timeline: {world_size} processes, {device.type}, {backend}", "",
             f"Median over {args.steps} profiled steps x {world_size} ranks, batch {args.batch_size} per rank.", "",
             "| model | variant | buckets | step ms | all-reduce ms | hidden under backward | backward waited ms |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for (model_name, variant), every in results.items():
        med = summary["results"][f"{model_name}/{variant}"] = medians(every, device.type)
        timed = [f"{med['allreduce_s'] * 1e3:.1f}", f"{med['hidden_share']:.0%}", f"{med['backward_wait_s'] * 1e3:.1f}"
                 ] if med["hidden_share"] is not None else ["not measured on CUDA"] * 3
        lines.append(f"| {model_name} | {variant} | {med['buckets']} | {med['step_s'] * 1e3:.1f} | " + " | ".join(timed)
                     + " |")
    course.atomic_write_bytes(json.dumps(summary, indent=1).encode(), out / "timeline.json")
    course.atomic_write_bytes(("\n".join(lines) + "\n").encode(), out / "timeline.md")
    pngs = [draw(out, model_name, results, summary) for model_name in args.models]
    course.say("\n".join(lines))
    course.say(f"written: {out / 'timeline.json'}, {out / 'timeline.md'}, {', '.join(map(str, filter(None, pngs)))}; "
               f"traces in {args.trace_dir}/")


def draw(out, model_name, results, summary):
    try:
        import matplotlib
    except ImportError:
        course.say("matplotlib is not installed: no picture (the numbers are in timeline.json)")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"forward": "#9ecae1", "backward": "#3182bd", "backward waits": "#bdbdbd", "optimizer": "#a1d99b",
              "all-reduce": "#e6550d"}
    fig, axes = plt.subplots(1, len(VARIANTS), figsize=(6 * len(VARIANTS), 1.6 + 0.9 * len(results[
        (model_name, "default")])), squeeze=False)
    for ax, variant in zip(axes[0], VARIANTS, strict=True):
        every = results[(model_name, variant)]
        origin = min(steps[-1]["phases"][0][1] for steps in every)  # the last profiled step, on every rank
        for rank, steps in enumerate(every):
            step = steps[-1]
            y = 2 * (len(every) - 1 - rank)
            for name, start, end, *compute_end in step["phases"]:
                parts = [(name, start, end)] if not compute_end else \
                    [(name, start, compute_end[0]), ("backward waits", compute_end[0], end)]  # for the all-reduce
                for part, a, b in parts:
                    ax.barh(y + 1, (b - a) * 1e3, left=(a - origin) * 1e3, height=0.8, color=colors[part],
                            edgecolor="white", linewidth=0.5)
            for _, start, end, _ in step["buckets"]:
                ax.barh(y, (end - start) * 1e3, left=(start - origin) * 1e3, height=0.8, color=colors["all-reduce"],
                        edgecolor="black", linewidth=0.5)
        ax.set_yticks([v for r in range(len(every)) for v in (2 * r, 2 * r + 1)])
        ax.set_yticklabels([lab for r in reversed(range(len(every))) for lab in
                            (f"rank {r} all-reduce", f"rank {r} compute")], fontsize=8)
        med = summary["results"][f"{model_name}/{variant}"]
        ax.set_title(f"{variant}: {med['buckets']} bucket(s), " + (
            f"{med['hidden_share']:.0%} of all-reduce hidden" if med["hidden_share"] is not None
            else "times the host queued the work (CUDA), not when it ran"), fontsize=10)
        ax.set_xlabel("ms since the step began (last profiled step)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, list(colors), loc="upper right", ncol=len(colors), fontsize=8)
    fig.suptitle(f"DDP {model_name}: backward and the gradient all-reduce, per rank", x=0.25)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    path = out / f"timeline_{model_name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main():
    parser = course.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=course.positive_int, default=2, help="processes to start")
    parser.add_argument("--models", default="resnet18,convnet", help="comma-separated: resnet18, convnet")
    parser.add_argument("--batch-size", type=course.positive_int, default=16, help="per rank (and micro-batch)")
    parser.add_argument("--steps", type=course.positive_int, default=3, help="profiled steps per variant")
    parser.add_argument("--warmup", type=course.positive_int, default=2, help="steps before profiling")
    parser.add_argument("--output-dir", default="runs/timeline")
    parser.add_argument("--trace-dir", help="where the Chrome traces go (default: OUTPUT_DIR/traces)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    parser.add_argument("--timeout", type=course.positive_float, default=120.0, help="collective timeout, seconds")
    args = parser.parse_args()
    args.models = [m for m in args.models.split(",") if m]
    if not args.models or set(args.models) - {"resnet18", "convnet"}:
        parser.error(f"--models: choose from resnet18, convnet (got {','.join(args.models) or 'none'})")
    if args.nproc < 2:
        parser.error("--nproc must be at least 2: one process has nothing to all-reduce with")
    args.trace_dir = args.trace_dir or str(Path(args.output_dir) / "traces")
    try:
        for folder in (args.output_dir, args.trace_dir):
            Path(folder).mkdir(parents=True, exist_ok=True)
        course.choose_device(args.device, args.backend, procs_per_node=args.nproc)  # one-line errors, here
    except (OSError, course.UsageError) as err:
        parser.error(str(err))
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(common.free_port())
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's own status lines (USDT: profiler_start, ...)
    try:
        mp.spawn(worker, args=(args.nproc, args), nprocs=args.nproc, join=True)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
        sys.exit(f"ddp_timeline: a worker failed, all stopped.\n{course.worker_error(err)}")


if __name__ == "__main__":
    main()
