"""Watch a DDP run from outside: what each rank trained and evaluated on, its weights, the files it wrote.

The scripts know nothing of it. The tests, the mutation check and `make doctor` start a run with
COURSE_TRACE=DIR and tools/trace/ on PYTHONPATH (see tools/trace/sitecustomize.py); every process of the run
then calls install(DIR) at start-up, which wraps a few PyTorch entry points, and appends one JSON line per event
to DIR/trace-PID.jsonl:

    init      init_process_group: backend, world size, rank, torchrun's restart count, the timeout= given, and
              the NCCL_* and GLOO_* variables the process saw
    loader    a DataLoader pass starts (its first batch): the sampler's kind and settings, every index it will hand
              out in that pass (a sized sampler of a map-style data set; an unsized one's indices come with
              pass_end), and a first guess of training or evaluation (autograd on or off)
    pass_end  the pass ends, is left, or the process exits: what it turned out to be ("train" when an optimizer
              stepped or a backward ran while it handed out batches, "eval" when read to its end without either,
              "peek" when left early without either, as `next(iter(loader))` does), the batches handed out, the
              batches fetched by its first optimizer step; for an IterableDataset (single-process loader) a
              fingerprint of every item it yielded, and of the rest of the stream read for up to 3 seconds after a
              cut (tools/tracecheck.py reads each loader event with its pass_end)
    set_epoch DistributedSampler.set_epoch(epoch)
    ddp       a DistributedDataParallel wrap: its settings, and the classes of the model's normalisation layers
    no_sync   DistributedDataParallel.no_sync(): a backward that keeps its gradients and all-reduces nothing
    digest    when an evaluation loader starts with autograd off, at destroy_process_group, and when an optimizer is
              freed: a CRC-32 of the parameters of every optimizer (the trained weights, wrapped in DDP or not) and
              of the buffers of every DDP module; and ("forward") at the first forward of a DDP model's module in
              eval mode in each pass: the buffers it evaluates with, after DDP's own pre-forward buffer broadcast
    coll      a collective called from Python (all_reduce, reduce, broadcast, all_gather, ...), not from torch's own
              code (torch.distributed.checkpoint's)
    save      torch.save, not from torch's own code: the file name
    load      torch.load of a dict (a checkpoint): the file name and a digest of each entry (model, optimizer,
              scaler, ...): a CRC-32 of its tensors with its other values
    resumed   the first optimizer step, and the first GradScaler step, after a load: a digest of the live
              optimizer's or GradScaler's state_dict() (an enabled GradScaler only), made as the entries above
    destroy   destroy_process_group
    error     an uncaught exception: its last lines
    exit      the interpreter exits normally (after the script's last line, before the teardown that can abort)

Two switches for the harness, both off unless set: COURSE_TRACE_MAX_BATCHES=N ends every training pass (one that
has stepped or run a backward) after N batches (a short run of a user's script), and COURSE_FAIL_AT=RANK:BATCH makes
that rank fail when it fetches training batch number BATCH (counted over the passes that start with autograd on: the
course's scripts evaluate under no_grad) on torchrun's first attempt (the elastic restart demo). BATCH
`mid` is the middle batch of the last epoch (the script's parsed --epochs and --max-steps; epoch 2 when it has no
--epochs), counted from the batches this process really fetches, so it falls in that epoch whatever the data set
size, the number of processes and the batch size.
tools/tracecheck.py reads the records and judges them.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import json
import os
import sys
import time
import traceback
import weakref
import zlib

_state = {"dir": None, "pid": None, "file": None, "batches": 0, "passes": 0, "args": {}, "open": weakref.WeakSet(),
          "current": None, "newest": None}
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


def _state_digest(value) -> str:
    """One digest of a state_dict (nested dicts and lists of tensors and plain values): equal states, equal digests."""
    def canonical(v):
        if hasattr(v, "detach"):  # a tensor: its dtype, shape and bytes
            return f"{v.dtype}{tuple(v.shape)}:{_crc([v])}"
        if isinstance(v, dict):
            return {str(k): canonical(x) for k, x in sorted(v.items(), key=lambda kv: str(kv[0]))}
        if isinstance(v, (list, tuple)):
            return [canonical(x) for x in v]
        return repr(v)

    return f"{zlib.crc32(json.dumps(canonical(value), sort_keys=True).encode()):08x}"


def _loaded(out, f, *_, **__):
    """torch.load returned: a checkpoint's entries, and the restored states to compare at the next steps."""
    if isinstance(out, dict):
        _state["resume"] = {"optimizer", "scaler"}
        record("load", path=os.path.abspath(f if isinstance(f, (str, os.PathLike)) else getattr(f, "name", "?")),
               state={str(k): _state_digest(v) for k, v in out.items() if isinstance(v, dict)})


def _resumed(what: str, state_dict) -> None:
    """The first step of the optimizer or GradScaler after a load (state_dict: its bound method, called only then)."""
    if what in _state.get("resume", ()):
        _state["resume"].discard(what)
        state = state_dict()
        if state:  # a disabled GradScaler has no state to restore
            record("resumed", what=what, digest=_state_digest(state))


def _digest(when: str) -> None:
    params = [p for opt in _optimizers for group in opt.param_groups for p in group["params"]]
    buffers = [b for ddp in _ddps for b in ddp.module.buffers()]
    sharded = any(hasattr(p, "to_local") for p in params)  # FSDP2: DTensor shards; how many are left plain
    record("digest", when=when, params=_crc(params), buffers=_crc(buffers), optimizers=len(_optimizers),
           ddp_modules=len(_ddps), unsharded=sum(not hasattr(p, "to_local") for p in params) if sharded else None)


class _Watched:
    """A DataLoader's sampler (or batch sampler), seen through: records what it hands out, changes nothing."""

    def __init__(self, inner, loader):
        self._inner, self._loader = inner, loader

    def __len__(self):
        return len(self._inner)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __iter__(self):
        _state["newest"] = _Pass(self._inner, self._loader)
        return _state["newest"]


class _Pass:
    """One pass over a DataLoader (one iterator of it). Its kind is decided by what the loop does while it hands out
    batches: an optimizer step or a backward makes it training; a pass read to its end without either is an
    evaluation; one left early without either (a peek at one batch) is no epoch at all. The "loader" event is written
    at its first batch, the "pass_end" event with the kind when it ends, is left, or the process exits."""

    count = 0

    def __init__(self, inner, loader):
        _Pass.count += 1
        self.id, self.inner, self.loader, self.it, self.n, self.work = _Pass.count, inner, loader, None, 0, 0
        self.ended, self.complete, self.truncated, self.samples, self.drawn, self.train = False, False, False, None, \
            None, False
        self.steps, self.first_step_at = 0, None
        self.feed = None  # an IterableDataset's items as the loader's fetcher reads them (single-process loaders)

    def __iter__(self):
        return self

    def _start(self):
        import torch

        sampler = getattr(self.inner, "sampler", self.inner)
        settings = {key: getattr(sampler, key, None) for key in ("num_replicas", "rank", "shuffle", "seed",
                                                                  "epoch", "drop_last")}
        dataset = self.loader.dataset
        iterable = isinstance(dataset, torch.utils.data.IterableDataset)
        try:  # a sized sampler of a map-style data set is drawn whole, at the first batch, as the loader would
            items = None if iterable else list(self.inner) if len(self.inner) >= 0 else None
        except TypeError:  # no length: recorded as it is drawn
            items = None
        self.it = iter(items if items is not None else self.inner)
        flat = None if items is None else [int(i) for item in items
                                           for i in (item if isinstance(item, (list, tuple)) else [item])]
        if not iterable:
            self.drawn = [] if flat is None else None
        base = _base(dataset)
        if flat is not None:
            flat = _in_base(dataset, flat)
        self.train = torch.is_grad_enabled()  # provisional; the harness's switches below count these passes
        if not self.train:
            _digest("eval")
        for other in list(_state["open"]):
            if other is not self and other.loader is self.loader:
                other.end()  # the loader's earlier iterator was left: a new pass of it begins
        _state["open"].add(self)
        record("loader", train=self.train, sampler=type(sampler).__name__, settings=settings, indices=flat,
               batches=len(items) if items is not None else None, dataset_len=_len(base), loader=id(self.loader),
               batch_size=getattr(self.loader, "batch_size", None), iterable=iterable, pass_id=self.id,
               workers=getattr(self.loader, "num_workers", 0))
        self.limit = int(os.environ.get("COURSE_TRACE_MAX_BATCHES", "0") or 0)
        fail = os.environ.get("COURSE_FAIL_AT", "") if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" else ""
        self.fail_rank, self.fail = fail.split(":") if fail else (None, None)
        self.fail_spec = fail
        if self.train:
            _state["passes"] += 1
            fetched = min((n for n in (len(items) if items is not None else 0, self.limit,
                                       _state["args"].get("max_steps")) if n), default=0)
            self.fail = fail_batch(self.fail, _state["args"].get("epochs"), _state["batches"], _state["passes"],
                                   fetched) if fail else None

    def __next__(self):
        if self.it is None:
            self._start()
        if self.limit and self.n >= self.limit and self.work:  # a training pass, cut short from outside
            self.truncated = True
            self._drain()
            self.end()
            raise StopIteration
        try:
            item = next(self.it)
        except StopIteration:
            if not isinstance(self.loader.dataset, _iterable_type()):
                self.complete = True
            self.end()
            raise
        if self.drawn is not None:
            self.drawn.extend(int(i) for i in (item if isinstance(item, (list, tuple)) else [item]))
        self.n += 1
        _state["current"] = self
        if self.train:
            _state["batches"] += 1
            if self.fail is not None and _rank() == int(self.fail_rank) and _state["batches"] == self.fail:
                raise RuntimeError(f"simulated failure of rank {self.fail_rank} at training batch {self.fail} "
                                   f"(COURSE_FAIL_AT={self.fail_spec})")
        return item

    def _drain(self, seconds=3.0):
        """After a cut: read the rest of an IterableDataset's pass (not trained on) for a few seconds, so that the
        ranks' whole passes can be compared."""
        if self.feed is None:
            return
        deadline = time.time() + seconds
        for _ in self.feed:
            if time.time() > deadline:
                return

    def end(self):
        """Write the pass's kind, once."""
        if self.ended or self.it is None:
            return
        self.ended = True
        _state["open"].discard(self)
        kind = "train" if self.work else "eval" if self.complete else "peek"
        fields = {}
        if self.drawn is not None:
            fields["indices"] = _in_base(self.loader.dataset, self.drawn)
        if self.samples is not None:
            fields["samples"] = self.samples
        record("pass_end", pass_id=self.id, kind=kind, fetched=self.n, work=self.work, steps=self.steps,
               first_step_at=self.first_step_at, complete=self.complete, truncated=self.truncated, **fields)

    def __del__(self):
        try:
            self.end()
        except Exception:  # noqa: BLE001 - at interpreter exit the modules it needs may be gone
            pass


class _Feed:
    """An IterableDataset's iterator inside a single-process DataLoader: a fingerprint of every item it yields goes
    to its pass (items are compared across ranks by content: an IterableDataset has no indices)."""

    def __init__(self, inner, owner):
        self.inner, self.owner = inner, owner

    def __iter__(self):
        return self

    def __next__(self):
        try:
            item = next(self.inner)
        except StopIteration:
            self.owner.complete = True
            raise
        self.owner.samples.append(_fingerprint(item))
        return item


def _fingerprint(item) -> str:
    import torch

    crc = 0
    for part in (item if isinstance(item, (list, tuple)) else item.values() if isinstance(item, dict) else [item]):
        if isinstance(part, torch.Tensor):
            crc = zlib.crc32(part.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), crc)
        else:
            crc = zlib.crc32(repr(part).encode(), crc)
    return f"{crc:08x}"


def _iterable_type():
    import torch

    return torch.utils.data.IterableDataset


def _base(dataset):
    while hasattr(dataset, "indices") and hasattr(dataset, "dataset"):
        dataset = dataset.dataset
    return dataset


def _in_base(dataset, flat):
    """Indices of a Subset (of a Subset ...) as indices of its base data set."""
    while hasattr(dataset, "indices") and hasattr(dataset, "dataset"):
        flat, dataset = [int(dataset.indices[i]) for i in flat], dataset.dataset
    return flat


def fail_batch(spec: str, epochs, done: int, this_pass: int, pass_batches: int):
    """COURSE_FAIL_AT's BATCH as a training batch number counted over epochs from 1: a number as it is; `mid`, the
    middle of the last of `epochs` (2 when None) passes, decided when that pass starts (`this_pass`, counted from
    1, after `done` batches, with `pass_batches` to come), else None."""
    if spec != "mid":
        return int(spec)
    return done + pass_batches // 2 + 1 if this_pass == (epochs or 2) else None


def _by_torch() -> bool:
    """Whether the wrapped call comes from PyTorch's own code (torch.distributed.checkpoint's collectives and its
    torch.save of each rank's shard into memory), not from the script: not the script's doing, not recorded."""
    import torch

    frame = sys._getframe(3)  # this function, the hook, the wrapper, then the caller
    return frame.f_code.co_filename.startswith(os.path.dirname(torch.__file__))


def _collective(name):
    """A collective's "before" hook; its own keywords (op=, group=, ...) pass through untouched."""
    return lambda *_, **__: None if _by_torch() else record("coll", op=name)


def _evaluating(module, _inputs):
    """A DDP model's module runs in eval mode (its BatchNorm layers use their running statistics): the buffers it
    uses, once per pass, after DDP's pre-forward broadcast of rank 0's buffers when called through the wrapper."""
    if module.training:
        return
    current = _state["current"]
    key = (id(module), current.id if current is not None else None)
    if key != _state.get("evaluated"):
        _state["evaluated"] = key
        buffers = _crc(module.buffers())
        if buffers is not None:
            record("digest", when="forward", params=None, buffers=buffers, optimizers=0, ddp_modules=1)


def _exiting():
    """At interpreter exit: the passes still open end, and the process says it reached its end (a rank that then
    aborts, in the group's teardown, still finished its work)."""
    try:
        for open_pass in list(_state["open"]):
            open_pass.end()
        if _state["pid"] == os.getpid():
            record("exit")
    except Exception:  # noqa: BLE001
        pass


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
    from torch.utils.data._utils import fetch

    def fetcher_made(_, self, *args, **kwargs):  # made right after its iterator drew its pass (single process)
        owner = _state["newest"]
        if owner is not None and owner.feed is None and owner.loader.dataset is self.dataset:
            owner.samples = []
            self.dataset_iter = owner.feed = _Feed(self.dataset_iter, owner)

    _wrap(fetch._IterableDatasetFetcher, "__init__", after=fetcher_made)

    def working(*_, **__):  # a backward or an optimizer step: the pass handing out batches is a training pass
        if _state["current"] is not None:
            _state["current"].work += 1

    def stepped(*_):
        current = _state["current"]
        if current is not None:
            current.work += 1
            current.steps += 1
            current.first_step_at = current.first_step_at or current.n  # batches per step: accumulation

    _wrap(torch.autograd, "backward", before=working)
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(stepped)
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
        self.module.register_forward_pre_hook(_evaluating)  # after DDP's own pre-forward buffer broadcast

    _wrap(DistributedDataParallel, "__init__", after=ddp_made)
    _wrap(DistributedDataParallel, "no_sync", before=lambda self: record("no_sync"))
    _wrap(torch, "save", before=lambda obj, f, *a, **k: None if _by_torch() else record("save", path=os.path.abspath(
        f if isinstance(f, (str, os.PathLike)) else getattr(f, "name", "?"))))
    _wrap(torch, "load", after=_loaded)
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(lambda optimizer, *_: _resumed("optimizer", optimizer.state_dict))
    _wrap(torch.amp.GradScaler, "step", before=lambda self, *a, **k: _resumed("scaler", self.state_dict))

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
    atexit.register(_exiting)
    hook = sys.excepthook

    def failed(kind, value, tb):
        try:
            record("error", lines=traceback.format_exception(kind, value, tb)[-6:])
        finally:
            hook(kind, value, tb)

    sys.excepthook = failed
    for name in COLLECTIVES:
        if hasattr(dist, name):
            _wrap(dist, name, before=_collective(name))
