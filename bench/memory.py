"""Memory per rank of DDP, ZeRO (ZeroRedundancyOptimizer) and FSDP2 (fully_shard): the bytes of parameters,
gradients and optimizer state each process holds after one training step, at world sizes 1, 2 and 4.

Counted from the tensors themselves, not from the process's memory: for FSDP2 the local shard of each DTensor,
for ZeRO the state of this rank's part of the parameters. Adam (two moments per parameter, as most large models
are trained) makes the optimizer state twice the parameters. What is not counted: activations (they depend on
the batch, and FSDP2 also frees each block's gathered weights after use), DDP's gradient buckets (another copy
of the gradients unless gradient_as_bucket_view=True) and FSDP2's all-gather buffers (about one block at a time).
Bytes are a count, not a timing: one round tells everything. The ranks of a world size are forked from this
process (CPU, Gloo); at most 4 run at once.

    python bench/memory.py                 # ConvNet and ResNet-18 (CIFAR-shaped), world sizes 1, 2, 4
    python bench/memory.py --quick         # ConvNet only, world sizes 1 and 2
    make bench-memory
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import benchlib
import common

MODELS = {"convnet": (common.ConvNet, (1, 28, 28)), "resnet18": (common.resnet18_cifar, (3, 32, 32))}
METHODS = ("ddp", "zero", "fsdp2")
MiB = 2**20


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: only this rank's shard is here
        total += t.numel() * t.element_size()
    return total


def build(model_name: str, method: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = MODELS[model_name][0]()
    if method == "fsdp2":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        blocks = ([model.layer1, model.layer2] if model_name == "convnet" else
                  [block for layer in (model.layer1, model.layer2, model.layer3, model.layer4) for block in layer])
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)
    model = DDP(model)
    if method == "zero":
        return model, ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def measure(model_name: str, method: str) -> dict:
    model, optimizer = build(model_name, method)
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(4, *MODELS[model_name][1], generator=g)
    y = torch.randint(0, 10, (4,), generator=g)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    params = list(model.parameters())
    state = optimizer.optim.state if method == "zero" else optimizer.state  # ZeRO: this rank's own optimizer
    row = {"params": local_bytes(params), "grads": local_bytes(p.grad for p in params if p.grad is not None),
           "optimizer": local_bytes(v for s in state.values() for v in s.values()
                                    if torch.is_tensor(v) and v.dim() > 0)}  # Adam's step counts are scalars
    row["total"] = row["params"] + row["grads"] + row["optimizer"]
    return row


def in_mib(biggest: dict) -> dict:
    """The largest rank's bytes in MiB (2 decimals), and its total over DDP's at world size 1 ("vs_ddp")."""
    return {key: {ws: {**{part: round(n / MiB, 2) for part, n in row.items()},
                       "vs_ddp": round(row["total"] / biggest[f"{key.split('/')[0]}/ddp"]["1"]["total"], 2)}
                  for ws, row in by_ws.items()} for key, by_ws in biggest.items()}


def plot(path, mib: dict):
    """One bar per (model, method, world size): the largest rank's memory as a fraction of DDP's at world size 1."""
    labels = [f"{key.replace('/', ' ')} N={ws}" for key, by_ws in mib.items() for ws in by_ws]
    ratios = [row["vs_ddp"] for by_ws in mib.values() for row in by_ws.values()]
    colors = [{"ddp": "tab:gray", "zero": "tab:orange", "fsdp2": "tab:blue"}[key.split("/")[1]]
              for key, by_ws in mib.items() for _ in by_ws]
    return benchlib.bar_plot(path, labels, [{"median": r, "min": r, "max": r} for r in ratios],
                             "memory per rank / DDP's", "Weights + gradients + Adam state per rank: DDP (gray), "
                             "ZeRO (orange), FSDP2 (blue)", colors=colors)


def worker(rank: int, world_size: int, port: int, models: list[str], queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    try:
        rows = {f"{m}/{method}": measure(m, method) for m in models for method in METHODS}
        gathered = [None] * world_size
        dist.all_gather_object(gathered, rows)
        if rank == 0:
            queue.put(gathered)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = benchlib.make_parser(__doc__, "ConvNet only, world sizes 1 and 2")
    args = parser.parse_args()
    models = ["convnet"] if args.quick else list(MODELS)
    sizes = [1, 2] if args.quick else [1, 2, 4]
    per_rank: dict[str, dict[str, list[dict]]] = {}  # "model/method" -> world size -> one row per rank
    for world_size in sizes:
        started, queue = time.time(), mp.get_context("fork").SimpleQueue()
        mp.start_processes(worker, (world_size, common.free_port(), models, queue), nprocs=world_size,
                           start_method="fork")
        for key in (gathered := queue.get())[0]:
            per_rank.setdefault(key, {})[str(world_size)] = [g[key] for g in gathered]
        print(f"world size {world_size}: {time.time() - started:.1f} s", flush=True)

    device = torch.device("cpu")
    name = benchlib.stem("memory", device, "gloo", args.quick)
    biggest = {key: {ws: {part: max(r[part] for r in rows) for part in rows[0]} for ws, rows in by_ws.items()}
               for key, by_ws in per_rank.items()}
    md = [f"# Memory per rank: DDP, ZeRO, FSDP2 (cpu, gloo, Adam), {time.strftime('%Y-%m-%d')}", "",
          f"torch {torch.__version__}; MiB per rank after one training step (the largest rank where they differ); "
          f"activations, DDP's buckets and FSDP2's all-gather buffers not counted (bench/memory.py).", ""]
    mib = in_mib(biggest)
    rows = [[*key.split("/"), ws, *(f"{row[p]:.2f}" for p in ("params", "grads", "optimizer", "total", "vs_ddp"))]
            for key, by_ws in mib.items() for ws, row in by_ws.items()]
    md += benchlib.md_table(["model", "method", "world size", "parameters", "gradients", "optimizer state",
                             "total", "vs DDP"], rows)
    payload = {"bench": "memory", "quick": args.quick, "machine": benchlib.machine_info(device, "gloo"),
               "optimizer": "Adam", "unit": "bytes", "per_rank": per_rank, "max_over_ranks": biggest, "mib": mib}
    out = Path(args.output_dir)
    paths = benchlib.write_results(out, name, payload, md)
    png = plot(out / f"{name}.png", mib)
    print("\n".join(md))
    print("wrote", *paths, *([png] if png else []))


if __name__ == "__main__":
    main()
