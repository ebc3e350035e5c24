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

Written to --output-dir (default runs/timeline) by timeline_report.py, which turns the times into numbers and
pictures: timeline.json/.md (medians over steps and ranks), timeline_<model>.png (per rank a compute lane and an
all-reduce lane, the variants side by side), and traces/<model>_<variant>_rank<r>.json, the profiler's Chrome trace
with the hook's times added as their own lane (open it in https://ui.perfetto.dev or chrome://tracing).

All times are taken on the host. On the CPU that is when the work ran; on CUDA it is only when the work was
queued (an NCCL all-reduce counts as done once it is queued on its stream), so there the script reports the step
times (each step ends with a synchronize) and says the all-reduce and overlap figures are not measured: the trace's
GPU lanes show the kernels, the NCCL ones on their own stream. A small model such as the ConvNet fits in one
bucket: there is nothing to overlap, and its default and one-bucket timelines look alike.
"""

import argparse
import contextlib
import gc
import os
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
import timeline_report  # the numbers and pictures (this script's folder is on the path)

VARIANTS = {"default": {}, "one-bucket": {"bucket_cap_mb": 10_000}, "no-sync": {}}
MICRO_BATCHES = 4  # no-sync: micro-batches per optimizer step


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
    timeline_report.add_lane(trace_path, steps, marks)  # the hook's times, on the profiler's clock
    return steps


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def worker(rank, world_size, args):
    device, backend = common.device_and_backend(args.device, args.backend, rank, world_size)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=args.timeout),
                            device_id=device if backend == "nccl" else None)
    try:
        results = {}
        for model_name in args.models:
            for variant in VARIANTS:
                trace = Path(args.trace_dir) / f"{model_name}_{variant}_rank{rank}.json"
                steps = measure(model_name, variant, args, device, rank, trace)
                every = [None] * world_size
                dist.all_gather_object(every, steps)  # rank 0 reports every rank's steps
                results[f"{model_name}/{variant}"] = every
                if rank == 0:
                    print(f"{model_name:8s} {variant:10s} " + timeline_report.describe(every, device.type), flush=True)
        if rank == 0:
            config = {"world_size": world_size, "device": device.type, "backend": backend, "torch": torch.__version__,
                      "batch_size": args.batch_size, "steps": args.steps, "warmup": args.warmup,
                      "micro_batches_no_sync": MICRO_BATCHES}
            timeline_report.write(Path(args.output_dir), config, results)
        # every rank finishes before any leaves; on Gloo not barrier(), which would hold on to the hook's collectives
        # still in flight for a Gloo thread to free, maybe while Python exits (05's README)
        dist.monitored_barrier() if backend == "gloo" else dist.barrier()
    finally:
        gc.collect()  # a workaround, not DDP: free the DDP model (it lives in reference cycles) before its group
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="processes to start")
    parser.add_argument("--models", default="resnet18,convnet", help="comma-separated: resnet18, convnet")
    parser.add_argument("--batch-size", type=int, default=16, help="per rank (and micro-batch)")
    parser.add_argument("--steps", type=int, default=3, help="profiled steps per variant")
    parser.add_argument("--warmup", type=int, default=2, help="steps before profiling (DDP rebuilds its buckets)")
    parser.add_argument("--output-dir", default="runs/timeline")
    parser.add_argument("--trace-dir", help="where the Chrome traces go (default: OUTPUT_DIR/traces)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    parser.add_argument("--timeout", type=float, default=120.0, help="collective timeout, seconds")
    args = parser.parse_args()
    args.models = [m for m in args.models.split(",") if m]
    if not args.models or set(args.models) - {"resnet18", "convnet"}:
        parser.error(f"--models: choose from resnet18, convnet (got {','.join(args.models) or 'none'})")
    if args.nproc < 2:
        parser.error("--nproc must be at least 2: one process has nothing to all-reduce with")
    if min(args.batch_size, args.steps, args.warmup) < 1:
        parser.error("--batch-size, --steps and --warmup must be at least 1")
    args.trace_dir = args.trace_dir or str(Path(args.output_dir) / "traces")
    for folder in (args.output_dir, args.trace_dir):
        Path(folder).mkdir(parents=True, exist_ok=True)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(common.free_port())
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does: N processes x all cores would fight
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's own status lines (USDT: profiler_start, ...)
    try:
        mp.spawn(worker, args=(args.nproc, args), nprocs=args.nproc, join=True)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
        sys.exit(f"ddp_timeline: a worker failed, all stopped.\n{err}")


if __name__ == "__main__":
    main()
