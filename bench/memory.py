"""Memory per rank of DDP, ZeRO (ZeroRedundancyOptimizer) and FSDP2 (fully_shard) after one training step with
Adam, at world sizes 1, 2 and 4.

Tensor bytes, counted from the tensors themselves: the parameters, gradients and optimizer state each rank holds
(for FSDP2 the local shard of each DTensor, for ZeRO the state of this rank's part; Adam's two moments make the
state twice the parameters), and beside them the communication buffer each method adds: DDP's gradient buckets
(ZeRO's model is a DDP model too), another copy of the gradients unless gradient_as_bucket_view=True makes the
gradients views into them (DDP reports their sizes), and FSDP2's all-gather output, which holds a unit's whole
weights while the unit runs (the largest unit's, counted from its parameters). Not counted: activations, FSDP2's
reduce-scatter buffers in backward and a prefetched next unit, the allocator's cache. With --device cuda (one GPU per
rank, NCCL) every rank also reports torch.cuda.max_memory_allocated() since its model was built, which holds all of
those. Bytes are a count, not a timing: one round tells everything. The ranks of a world size are forked from this
process (spawned on CUDA); at most 4 run at once.

    python bench/memory.py                 # ConvNet and ResNet-18 (CIFAR-shaped), world sizes 1, 2, 4, on the CPU
    python bench/memory.py --quick         # ConvNet only, world sizes 1 and 2
    python bench/memory.py --device cuda   # on GPUs, up to one rank per GPU: also the allocator's peak per rank
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


def build(model_name: str, method: str, device: torch.device):
    """The model wrapped for `method`, its Adam optimizer, and the bytes of its communication buffer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = MODELS[model_name][0]().to(device)
    if method == "fsdp2":
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        blocks = ([model.layer1, model.layer2] if model_name == "convnet" else
                  [block for layer in (model.layer1, model.layer2, model.layer3, model.layer4) for block in layer])
        in_blocks = {id(p) for block in blocks for p in block.parameters()}
        units = [list(block.parameters()) for block in blocks]
        units.append([p for p in model.parameters() if id(p) not in in_blocks])  # the root's own: what no block took
        gathered = max(local_bytes(unit) for unit in units)  # before sharding: whole tensors
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.Adam(model.parameters(), lr=1e-3), gathered
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if method == "zero":
        return model, ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3), None
    return model, torch.optim.Adam(model.parameters(), lr=1e-3), None


def measure(model_name: str, method: str, device: torch.device) -> dict:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model, optimizer, gathered = build(model_name, method, device)
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(4, *MODELS[model_name][1], generator=g).to(device)
    y = torch.randint(0, 10, (4,), generator=g).to(device)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    params = list(model.parameters())
    state = optimizer.optim.state if method == "zero" else optimizer.state  # ZeRO: this rank's own optimizer
    row = {"params": local_bytes(params), "grads": local_bytes(p.grad for p in params if p.grad is not None),
           "optimizer": local_bytes(v for s in state.values() for v in s.values()
                                    if torch.is_tensor(v) and v.dim() > 0)}  # Adam's step counts are scalars
    row["total"] = row["params"] + row["grads"] + row["optimizer"]
    if gathered is None:  # DDP's own record of its buckets (bytes, comma-separated); none apart from the gradients
        logged = model._get_ddp_logging_data()  # when they are views into the buckets
        gathered = 0 if logged.get("gradient_as_bucket_view") else sum(
            int(size) for size in str(logged["bucket_sizes"]).split(","))
    row["buffer"] = gathered
    row["with_buffer"] = row["total"] + row["buffer"]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        row["peak_allocated"] = torch.cuda.max_memory_allocated(device)
    return row


def in_mib(biggest: dict) -> dict:
    """The largest rank's bytes in MiB (2 decimals), and over DDP's at world size 1: its total ("vs_ddp") and its
    total with the buffer ("with_buffer_vs_ddp")."""
    def ddp(key):
        return biggest[f"{key.split('/')[0]}/ddp"]["1"]

    return {key: {ws: {**{part: round(n / MiB, 2) for part, n in row.items()},
                       "vs_ddp": round(row["total"] / ddp(key)["total"], 2),
                       "with_buffer_vs_ddp": round(row["with_buffer"] / ddp(key)["with_buffer"], 2)}
                  for ws, row in by_ws.items()} for key, by_ws in biggest.items()}


def plot(path, mib: dict):
    """One bar per (model, method, world size): the largest rank's tensors with the communication buffer, as a
    fraction of DDP's at world size 1."""
    labels = [f"{key.replace('/', ' ')} N={ws}" for key, by_ws in mib.items() for ws in by_ws]
    ratios = [row["with_buffer_vs_ddp"] for by_ws in mib.values() for row in by_ws.values()]
    colors = [{"ddp": "tab:gray", "zero": "tab:orange", "fsdp2": "tab:blue"}[key.split("/")[1]]
              for key, by_ws in mib.items() for _ in by_ws]
    return benchlib.bar_plot(path, labels, [{"median": r, "min": r, "max": r} for r in ratios],
                             "memory per rank / DDP's", "Weights + gradients + Adam state + communication buffer "
                             "per rank: DDP (gray), ZeRO (orange), FSDP2 (blue)", colors=colors)


def worker(rank: int, world_size: int, port: int, models: list[str], device_type: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=120), device_id=device if device.type == "cuda" else None)
    try:
        rows = {f"{m}/{method}": measure(m, method, device) for m in models for method in METHODS}
        gathered = [None] * world_size
        dist.all_gather_object(gathered, rows)
        if rank == 0:
            queue.put(gathered)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = benchlib.make_parser(__doc__, "ConvNet only, world sizes 1 and 2")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cpu: Gloo (default); cuda: one GPU per rank, NCCL, and each rank's allocator peak")
    args = parser.parse_args()
    models = ["convnet"] if args.quick else list(MODELS)
    sizes = [1, 2] if args.quick else [1, 2, 4]
    cuda = args.device == "cuda"
    if cuda:
        gpus = torch.cuda.device_count()
        sizes = [n for n in sizes if n <= gpus]
        if not sizes:
            parser.error("--device cuda needs a CUDA GPU")
    # a process that has touched CUDA cannot fork ranks that use it: spawn them on CUDA
    context = mp.get_context("spawn" if cuda else "fork")
    per_rank: dict[str, dict[str, list[dict]]] = {}  # "model/method" -> world size -> one row per rank
    for world_size in sizes:
        started, queue = time.time(), context.SimpleQueue()
        mp.start_processes(worker, (world_size, common.free_port(), models, args.device, queue), nprocs=world_size,
                           start_method=context.get_start_method())
        for key in (gathered := queue.get())[0]:
            per_rank.setdefault(key, {})[str(world_size)] = [g[key] for g in gathered]
        print(f"world size {world_size}: {time.time() - started:.1f} s", flush=True)

    device, backend = (torch.device("cuda", 0), "nccl") if cuda else (torch.device("cpu"), "gloo")
    name = benchlib.stem("memory", device, backend, args.quick)
    biggest = {key: {ws: {part: max(r[part] for r in rows) for part in rows[0]} for ws, rows in by_ws.items()}
               for key, by_ws in per_rank.items()}
    md = [f"# Memory per rank: DDP, ZeRO, FSDP2 ({device.type}, {backend}, Adam), {time.strftime('%Y-%m-%d')}", "",
          f"torch {torch.__version__}; tensor bytes per rank after one training step, in MiB (the largest rank where "
          f"they differ): parameters, gradients, optimizer state and their total, then the communication buffer "
          f"beside them (DDP and ZeRO: DDP's gradient buckets; FSDP2: the largest unit's gathered weights); "
          f"activations not counted" + ("; peak: torch.cuda.max_memory_allocated()" if cuda else "") +
          " (bench/memory.py).", ""]
    mib = in_mib(biggest)
    parts = ["params", "grads", "optimizer", "total", "buffer", "with_buffer", "with_buffer_vs_ddp"]
    parts += ["peak_allocated"] if cuda else []
    rows = [[*key.split("/"), ws, *(f"{row[p]:.2f}" for p in parts)] for key, by_ws in mib.items()
            for ws, row in by_ws.items()]
    md += benchlib.md_table(["model", "method", "world size", "parameters", "gradients", "optimizer state", "total",
                             "buffer", "total + buffer", "vs DDP"] + (["peak allocated"] if cuda else []), rows)
    payload = {"bench": "memory", "quick": args.quick, "machine": benchlib.machine_info(device, backend),
               "optimizer": "Adam", "unit": "bytes", "per_rank": per_rank, "max_over_ranks": biggest, "mib": mib}
    out = Path(args.output_dir)
    paths = benchlib.write_results(out, name, payload, md)
    png = plot(out / f"{name}.png", mib)
    print("\n".join(md))
    print("wrote", *paths, *([png] if png else []))


if __name__ == "__main__":
    main()
