"""Watch a DDP run from outside: what each rank trained and evaluated on, its weights, the files it wrote.

The scripts know nothing of it. The tests, the mutation check and `make doctor` start a run with
COURSE_TRACE=DIR and tools/trace/ on PYTHONPATH (see tools/trace/sitecustomize.py); every process of the run
then calls install(DIR) at start-up, which wraps a few PyTorch entry points, and appends one JSON line per event
to DIR/trace-PID.jsonl:

    init      init_process_group: backend, world size, rank, torchrun's restart count, the timeout= given, and
              the NCCL_* and GLOO_* variables the process saw
    loader    a DataLoader starts an epoch: training or evaluation (autograd on or off), the sampler's kind and
              settings, and every index it will hand out in that pass
    set_epoch DistributedSampler.set_epoch(epoch)
    ddp       a DistributedDataParallel wrap: its settings, and the classes of the model's normalisation layers
    no_sync   DistributedDataParallel.no_sync(): a backward that keeps its gradients and all-reduces nothing
    digest    when an evaluation starts, at destroy_process_group, and when an optimizer is freed: a CRC-32 of
              the parameters of every optimizer (the trained weights, wrapped in DDP or not) and of the buffers
              of every DDP module
    coll      a collective called from Python (all_reduce, reduce, broadcast, all_gather, ...)
    save      torch.save: the file name
    destroy   destroy_process_group

Two switches for the harness, both off unless set: COURSE_TRACE_MAX_BATCHES=N ends every training pass after N
batches (a short run of a user's script), and COURSE_FAIL_AT=RANK:BATCH makes that rank fail when it fetches
training batch number BATCH (counted over epochs) on torchrun's first attempt (the elastic restart demo). BATCH
`mid` is the middle batch of the last epoch (the script's parsed --epochs and --max-steps; epoch 2 when it has no
--epochs), counted from the batches this process really fetches, so it falls in that epoch whatever the data set
size, the number of processes and the batch size.
tools/tracecheck.py reads the records and judges them.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
import weakref
import zlib

_state = {"dir": None, "pid": None, "file": None, "batches": 0, "passes": 0, "args": {}}
_optimizers: weakref.WeakSet = weakref.WeakSet()
_ddps: weakref.WeakSet = weakref.WeakSet()
COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "gather", "gather_object", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "barrier")
REDUCTIONS = ("all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "gather",
              "gather_object", "reduce_scatter", "reduce_scatter_tensor")


def _rank():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        _state["rank"] = dist.get_rank()  # remembered for events after destroy_process_group
        return _state["rank"]
    if _state.get("rank") is not None:
        return _state["rank"]
    return int(os.environ["RANK"]) if os.environ.get("RANK", "").isdigit() else None


def record(event: str, **fields) -> None:
    """Append one event to this process's trace file (reopened after a fork: one file per process)."""
    if _state["pid"] != os.getpid():
        _state["pid"] = os.getpid()
        _state["file"] = open(os.path.join(_state["dir"], f"trace-{os.getpid()}.jsonl"), "a")  # noqa: SIM115
    line = {"ev": event, "rank": _rank(), "pid": os.getpid(), "t": round(time.time(), 4), **fields}
    _state["file"].write(json.dumps(line) + "\n")
    _state["file"].flush()


def _crc(tensors) -> str | None:
    import torch

    crc, seen = 0, False
    for t in tensors:
        seen = True
        t = t.to_local() if hasattr(t, "to_local") else t  # FSDP2's DTensor: this rank's shard
        crc = zlib.crc32(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), crc)
    return f"{crc:08x}" if seen else None


def _digest(when: str) -> None:
    params = [p for opt in _optimizers for group in opt.param_groups for p in group["params"]]
    buffers = [b for ddp in _ddps for b in ddp.module.buffers()]
    record("digest", when=when, params=_crc(params), buffers=_crc(buffers), optimizers=len(_optimizers),
           ddp_modules=len(_ddps))


class _Watched:
    """A DataLoader's sampler (or batch sampler), seen through: records what it hands out, changes nothing."""

    def __init__(self, inner, loader):
        self._inner, self._loader = inner, loader

    def __len__(self):
        return len(self._inner)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __iter__(self):
        return self._epoch()

    def _epoch(self):
        import torch

        items = list(self._inner)  # at the first batch, when the loader itself would draw them
        train = torch.is_grad_enabled()
        sampler = getattr(self._inner, "sampler", self._inner)
        settings = {key: getattr(sampler, key, None) for key in ("num_replicas", "rank", "shuffle", "seed",
                                                                  "epoch", "drop_last")}
        flat = [int(i) for item in items for i in (item if isinstance(item, (list, tuple)) else [item])]
        dataset = self._loader.dataset
        while hasattr(dataset, "indices") and hasattr(dataset, "dataset"):  # a Subset: its indices in the base set
            flat, dataset = [int(dataset.indices[i]) for i in flat], dataset.dataset
        if not train:
            _digest("eval")
        record("loader", train=train, sampler=type(sampler).__name__, settings=settings, indices=flat,
               batches=len(items), dataset_len=_len(dataset), loader=id(self._loader),
               batch_size=getattr(self._loader, "batch_size", None))
        limit = int(os.environ.get("COURSE_TRACE_MAX_BATCHES", "0") or 0)
        fail = os.environ.get("COURSE_FAIL_AT", "") if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" else ""
        rank, batch = fail.split(":") if fail else (None, None)
        if train:
            _state["passes"] += 1
            fetched = min((n for n in (len(items), limit, _state["args"].get("max_steps")) if n), default=0)
            batch = fail_batch(batch, _state["args"].get("epochs"), _state["batches"], _state["passes"],
                               fetched) if fail else None
        for n, item in enumerate(items):
            if train and limit and n >= limit:
                return
            if train:
                _state["batches"] += 1
                if batch is not None and _rank() == int(rank) and _state["batches"] == batch:
                    raise RuntimeError(f"simulated failure of rank {rank} at training batch {batch} "
                                       f"(COURSE_FAIL_AT={fail})")
            yield item


def fail_batch(spec: str, epochs, done: int, this_pass: int, pass_batches: int):
    """COURSE_FAIL_AT's BATCH as a training batch number counted over epochs from 1: a number as it is; `mid`, the
    middle of the last of `epochs` (2 when None) passes, decided when that pass starts (`this_pass`, counted from
    1, after `done` batches, with `pass_batches` to come), else None."""
    if spec != "mid":
        return int(spec)
    return done + pass_batches // 2 + 1 if this_pass == (epochs or 2) else None


def _len(dataset):
    try:
        return len(dataset)
    except TypeError:
        return None


def _wrap(owner, name, before=None, after=None):
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if before:
            before(*args, **kwargs)
        out = original(*args, **kwargs)
        if after:
            after(out, *args, **kwargs)
        return out

    setattr(owner, name, wrapper)


def install(trace_dir: str) -> None:
    """Wrap the entry points (once per process) so that every event above lands in trace_dir."""
    if _state["dir"]:
        return
    os.makedirs(trace_dir, exist_ok=True)
    _state["dir"] = trace_dir
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    index_sampler = DataLoader._index_sampler
    DataLoader._index_sampler = property(lambda self: _Watched(index_sampler.fget(self), self))
    _wrap(DistributedSampler, "set_epoch", before=lambda self, epoch: record("set_epoch", epoch=int(epoch)))
    _wrap(argparse.ArgumentParser, "parse_known_args", after=lambda out, *a, **k: _state["args"].update(
        {key: value for key, value in getattr(out[0], "__dict__", {}).items()
         if key in ("epochs", "max_steps") and type(value) is int}))
    _wrap(torch.optim.Optimizer, "__init__", after=lambda _, self, *a, **k: _optimizers.add(self))

    def optimizer_freed(self):  # the trained weights, seen as the last reference to them goes (a train() returns)
        try:
            if _state.get("rank") is not None:
                params = [p for group in self.param_groups for p in group["params"]]
                record("digest", when="freed", params=_crc(params), buffers=None, optimizers=1, ddp_modules=0)
        except Exception:  # noqa: BLE001 - at interpreter exit the modules it needs may be gone
            pass

    torch.optim.Optimizer.__del__ = optimizer_freed

    def ddp_made(_, self, *args, **kwargs):
        _ddps.add(self)
        record("ddp", broadcast_buffers=self.broadcast_buffers, device_ids=[str(d) for d in self.device_ids or []],
               norms=sorted({type(m).__name__ for m in self.module.modules() if "Norm" in type(m).__name__}))

    _wrap(DistributedDataParallel, "__init__", after=ddp_made)
    _wrap(DistributedDataParallel, "no_sync", before=lambda self: record("no_sync"))
    _wrap(torch, "save", before=lambda obj, f, *a, **k: record("save", path=os.path.abspath(
        f if isinstance(f, (str, os.PathLike)) else getattr(f, "name", "?"))))

    def initialised(*_, **kwargs):
        timeout = kwargs.get("timeout")
        record("init", backend=str(dist.get_backend()), world_size=dist.get_world_size(),
               timeout=timeout.total_seconds() if hasattr(timeout, "total_seconds") else None,
               attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
               local_rank=os.environ.get("LOCAL_RANK"),
               env={k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "GLOO_"))})  # the network settings

    _wrap(dist, "init_process_group", after=initialised)

    def destroying(group=None, *_, **__):
        if group is None:
            _digest("destroy")
            record("destroy")

    _wrap(dist, "destroy_process_group", before=destroying)
    for name in COLLECTIVES:
        if hasattr(dist, name):
            _wrap(dist, name, before=functools.partial(lambda op, *_, **__: record("coll", op=op), name))
