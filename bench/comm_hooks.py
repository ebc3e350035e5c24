"""Communication compression with DDP comm hooks: fp16 and bf16 compression and PowerSGD against plain all-reduce.

For the course's ConvNet (one epoch of MNIST-shaped data, then the test accuracy) and ResNet-18 (a few steps of
CIFAR-shaped data, then the loss): bytes all-reduced per step, training images/s, and what the model learned.
A hook replaces DDP's all-reduce of each gradient bucket; compression sends fewer bytes but costs time to
compress, and PowerSGD approximates the gradients (a rank-2 low-rank approximation here, with error feedback).

    torchrun --standalone --nproc-per-node 2 bench/comm_hooks.py            # about 2 minutes on 2 CPU cores
    torchrun --standalone --nproc-per-node 2 bench/comm_hooks.py --quick    # a few steps: checks that it runs
    make bench-hooks

On CPUs with Gloo the compression often costs more than it saves: the network is memory, not a wire.
"""

from __future__ import annotations

import functools
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

import benchlib
import common
import workarounds
from tools import course, data

HOOKS = ["all_reduce", "fp16", "bf16", "powersgd"]
SENT = {"bytes": 0}  # bytes handed to dist.all_reduce by the hooks, counted by counting_all_reduce


def counting_all_reduce(original):
    def all_reduce(tensor, *args, **kwargs):
        SENT["bytes"] += tensor.numel() * tensor.element_size()
        return original(tensor, *args, **kwargs)
    return all_reduce


def attach(model: DDP, hook: str) -> None:
    if hook == "all_reduce":
        model.register_comm_hook(None, default_hooks.allreduce_hook)  # what DDP does without a hook, in Python
    elif hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "bf16":
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    else:
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                       min_compression_rate=2, use_error_feedback=True, warm_start=True)
        model.register_comm_hook(state, powersgd.powerSGD_hook)


@functools.cache  # read once, shared by the four hooks: training does not change a data set
def dataset(name: str, data_dir: str, train: bool):
    return common.load_dataset(name, data_dir, train=train)


def train(model_name: str, hook: str, cfg: dict, rank: int, ws: int, device: torch.device) -> dict:
    common.seed_everything(0)
    if model_name == "convnet":
        train_set = dataset("mnist-standin", cfg["data_dir"], train=True)
        test_set = dataset("mnist-standin", cfg["data_dir"], train=False)
        net, batch, steps = common.ConvNet(), 64, cfg["convnet_steps"]
    else:
        train_set = dataset("cifar10-standin", cfg["data_dir"], train=True)
        test_set = None
        net, batch, steps = common.resnet18_cifar(), cfg["resnet_batch"], cfg["resnet_steps"]
    sampler = DistributedSampler(train_set, num_replicas=ws, rank=rank, seed=0)
    loader = course.batch_loader(train_set, batch, sampler=sampler)
    model = DDP(net.to(device), device_ids=[device.index] if device.type == "cuda" else None)
    attach(model, hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    SENT["bytes"], times, losses = 0, [], []
    for step, (x, y) in enumerate(loader):
        if step == steps:
            break
        x, y = x.to(device), y.to(device)
        benchlib.sync(device)
        start = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        benchlib.sync(device)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    result = {"images_per_s": batch * ws / benchlib.summarize(times[2:] or times)["median"],
              "mb_per_step": SENT["bytes"] / max(1, len(times)) / 1e6,
              "final_loss": sum(losses[-4:]) / len(losses[-4:])}  # the last 4 steps
    if test_set is not None:
        totals = common.evaluate(model.module, course.batch_loader(test_set, 1000,
                                                                  sampler=range(rank, len(test_set), ws)), device)
        dist.all_reduce(totals)
        result["test_acc"] = (totals[0] / totals[1]).item()
    return result


def main(argv=None):
    parser = benchlib.make_parser(__doc__, "a few steps of each")
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        parser.error(f"start me with torchrun, e.g. torchrun --standalone --nproc-per-node 2 {__file__}")
    workarounds.stop_with_launcher()  # workaround: a killed launcher takes this worker with it
    local_ws = int(os.environ["LOCAL_WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    device, backend = common.device_and_backend(local_rank=int(os.environ["LOCAL_RANK"]), procs_per_node=local_ws)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        course.share_cpu_threads(local_ws)
    if int(os.environ["LOCAL_RANK"]) == 0:
        for dataset in ("mnist-standin", "cifar10-standin"):
            data.prepare(dataset, args.data_dir, quiet=True)
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout),
                            device_id=device if backend == "nccl" else None)
    dist.all_reduce = counting_all_reduce(dist.all_reduce)  # the hooks call dist.all_reduce: count the bytes
    try:
        ws = dist.get_world_size()
        cfg = {"data_dir": args.data_dir, "convnet_steps": 4 if args.quick else 10**9,
               "resnet_steps": 2 if args.quick else 12,
               "resnet_batch": 4 if args.quick else 16, "world_size": ws, "threads": torch.get_num_threads()}
        results = {}
        for model_name in ("convnet", "resnet18"):
            for hook in HOOKS:
                results[f"{model_name}/{hook}"] = train(model_name, hook, cfg, rank, ws, device)
                course.print0(rank, f"{model_name}/{hook}: " + ", ".join(
                    f"{k} {v:.4g}" for k, v in results[f"{model_name}/{hook}"].items()))
        if rank == 0:
            report(args, cfg, results, device, backend)
        # not barrier() on Gloo: it would hold on to the hooks' collectives in flight (05_collectives/README.md)
        dist.monitored_barrier() if backend == "gloo" else dist.barrier()
    finally:
        workarounds.free_ddp_models()  # workaround: free DDP objects before the group goes, or exit can abort
        dist.destroy_process_group()


def report(args, cfg, results, device, backend):
    machine = benchlib.machine_info(device, backend)
    name = benchlib.stem("comm_hooks", device, backend, args.quick)
    ratios = {f"{m}/{h}_vs_all_reduce": {"images_per_s": results[f"{m}/{h}"]["images_per_s"] /
                                         results[f"{m}/all_reduce"]["images_per_s"],
                                         "bytes": results[f"{m}/{h}"]["mb_per_step"] /
                                         results[f"{m}/all_reduce"]["mb_per_step"]}
              for m in ("convnet", "resnet18") for h in HOOKS if h != "all_reduce"}
    payload = {"bench": "comm_hooks", "machine": machine, "config": cfg, "quick": args.quick, "results": results,
               "ratios": ratios}
    md = [f"# DDP comm hooks, {cfg['world_size']} processes ({device.type}, {backend})", "",
          f"{machine['cpu']}, {machine['cores']} cores, torch {torch.__version__}. ConvNet: "
          f"{str(cfg['convnet_steps']) + ' steps' if args.quick else 'one epoch'} of the MNIST stand-in "
          f"(batch 64 per process), then the test accuracy; ResNet-18: {cfg['resnet_steps']} steps of the CIFAR-10 "
          f"stand-in (batch {cfg['resnet_batch']} per process). Last loss: the mean training loss of the last 4 steps "
          f"(rank 0). "
          f"images/s: the median step, one run (a rough guide; bench-buckets measures in rounds).", ""]
    rows = []
    for key, r in results.items():
        model, hook = key.split("/")
        ratio = ratios.get(f"{key}_vs_all_reduce", {"images_per_s": 1.0, "bytes": 1.0})
        rows.append([model, hook, f"{r['mb_per_step']:.3f}", f"{ratio['bytes']:.2f}", f"{r['images_per_s']:.0f}",
                     f"{ratio['images_per_s']:.2f}", f"{r['test_acc']:.4f}" if "test_acc" in r else "-",
                     f"{r['final_loss']:.3f}"])
    md += benchlib.md_table(["model", "hook", "MB all-reduced per step", "vs all_reduce", "images/s",
                             "vs all_reduce", "test accuracy", "last loss"], rows)
    out = Path(args.output_dir)
    paths = benchlib.write_results(out, name, payload, md)
    speeds = [{"median": r["images_per_s"], "min": r["images_per_s"], "max": r["images_per_s"]}
              for r in ratios.values()]
    png = benchlib.bar_plot(out / f"{name}.png", list(ratios), speeds, "images/s relative to plain all_reduce",
                            f"DDP comm hooks, {device.type}, {backend}", hline=1.0, hline_label="plain all_reduce")
    course.say("\n".join(md))
    course.say("written: " + ", ".join(str(p) for p in paths + ([png] if png else [])))


if __name__ == "__main__":
    main()
