"""The course's own machinery, which no lesson needs: one-line argument errors and the checks of the make targets'
preflight, the runtime report it prints, and what the benchmarks share (threads per process, batch loaders,
printing on rank 0, parsing the `kind: key=value` lines). No script in a numbered folder imports it.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler, TensorDataset

import common
from tools.lines import parse_lines  # noqa: F401 - course.parse_lines, as the tests and tools call it
from tools.util import UsageError, _atomic_write, atomic_write_bytes, say  # noqa: F401 - re-exported

# --------------------------------------------------------------------------- command line


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with a mistake reported in one line (no usage block), and once per node.

    Under torchrun every process parses the same command line; only local rank 0 of each node (or a process
    started without a launcher) prints the error, and every process exits with code 2. Once per node, not per
    job: a node's data or checkpoint folder can fail where rank 0's does not, and only that node can say so.
    """

    def error(self, message):
        if _speaks_for_the_job():
            about_flags = message.startswith(("argument ", "unrecognized arguments", "the following arguments"))
            hints = [f"the source notes' {flag} -> {NOTES_SPELLINGS[flag]}" for flag in _unrecognized(message)
                     if flag in NOTES_SPELLINGS]
            if "--local-rank" in message and "," in message:
                hints.append("torchrun gives every process its own LOCAL_RANK: drop --local_rank")
            said = "; ".join(hints) if hints else "--help lists them" if about_flags else ""
            sys.stderr.write(f"{self.prog}: error: {message}{f' ({said})' if said else ''}\n")
        self.exit(2)


# flags of the source notes' scripts that a course script does not take, and what it takes instead
NOTES_SPELLINGS = {
    "--num_epochs": "--epochs", "--learning_rate": "--lr", "--random_seed": "--seed",
    "--model_dir": "--checkpoint-dir", "--model_filename": "--checkpoint-dir (the file name is fixed)",
    "--resume": "nothing: a run continues the checkpoint in --checkpoint-dir by itself",
    "--local_world_size": "one process per GPU, torchrun --nproc-per-node N (DDP(device_ids=[a, b]) raises)",
    "--master_addr": "--init-method tcp://ADDR:PORT in 04_multinode_tcp (or torchrun --master-addr)",
    "--master_port": "--init-method tcp://ADDR:PORT in 04_multinode_tcp (or torchrun --master-port)",
    "--node_rank": "torchrun's --node-rank (or 04_multinode_tcp/mnist_tcp.py --node-rank)",
    "--nproc_per_node": "torchrun's --nproc-per-node", "--world_size": "torchrun's --nnodes x --nproc-per-node",
    "--use_mix_precision": "06_amp_syncbn/mnist_amp_syncbn.py --use_mix_precision (mixed precision is step 6)",
    "-g": "CUDA_VISIBLE_DEVICES=N in front of the command", "--gpuid": "CUDA_VISIBLE_DEVICES=N in front of the command",
}


def _unrecognized(message: str) -> list[str]:
    if not message.startswith("unrecognized arguments:"):
        return []
    return [word.split("=")[0] for word in message.split(":", 1)[1].split() if word.startswith("-")]


def _speaks_for_the_job() -> bool:
    """Local rank 0 speaks for its node (rank 0 for the job); so does a process started alone, or one whose RANK
    makes no sense."""
    try:
        rank, size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return True
    return rank == 0 or os.environ.get("LOCAL_RANK") == "0" or not 0 <= rank < size


def _number(kind, low: float, low_ok: bool, what: str):
    """An argparse type: a finite number of `kind` above `low` (or equal to it when low_ok)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(value) or value < low or (value == low and not low_ok):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    return parse


positive_int = _number(int, 1, True, "a whole number of at least 1")

positive_float = _number(float, 0.0, False, "a positive number")


def check_args(parser: argparse.ArgumentParser, args, *, rank: int = 0, world_size: int = 1, local_rank: int = 0,
               procs_per_node: int = 1) -> tuple[torch.device, str | None]:
    """Check the shared flags and this process's place in the job (PyTorch checks neither the ranks nor a
    file:// --init-method), then choose its device and backend and return them.

    Any mistake ends the program with one line (parser.error) before anything starts: make's preflight
    (tools/preflight.py) runs this once before a launch starts N processes. common.device_and_backend makes the
    choice.
    """
    data_dir = Path(args.data_dir)
    if data_dir.exists() and not data_dir.is_dir():
        parser.error(f"--data-dir {data_dir} is not a directory")
    if data_dir.exists() and not os.access(data_dir, os.R_OK | os.X_OK):
        parser.error(f"--data-dir {data_dir} is not readable")
    if not 0 <= rank < world_size or local_rank < 0:
        parser.error(f"rank {rank}, local rank {local_rank}, world size {world_size}: ranks run from 0 to "
                     f"world size - 1 (nodes x processes per node), local ranks from 0")
    try:
        if getattr(args, "checkpoint_dir", ""):
            _check_checkpoint_dir(Path(args.checkpoint_dir))
        if getattr(args, "init_method", None):
            _check_init_method(args.init_method)
        device, backend = common.device_and_backend(args.device, getattr(args, "backend", "auto"),
                                                    local_rank=local_rank, procs_per_node=procs_per_node)
        return device, backend if hasattr(args, "backend") else None  # a single-process script has no backend
    except (UsageError, RuntimeError) as err:
        parser.error(str(err))


def _check_checkpoint_dir(folder: Path) -> None:
    """Make the checkpoint folder, or say in one line why it cannot be written (before any training)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"--checkpoint-dir {folder} cannot be created: {err.strerror or err}") from None
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"--checkpoint-dir {folder} is not a writable folder")


def _check_init_method(init_method: str) -> None:
    """tcp://HOST:PORT, or file:// of a new file in a writable folder: anything else fails later, or hangs."""
    if init_method.startswith("tcp://"):
        return
    if not init_method.startswith("file://"):
        raise UsageError("--init-method must be tcp://HOST:PORT (rank 0's address) or file://PATH (a new file)")
    path = Path(init_method[len("file://"):])
    if not path.parent.is_dir() or not os.access(path.parent, os.W_OK):
        raise UsageError(f"{init_method}: the folder {path.parent} does not exist or is not writable")
    if path.exists() and time.time() - path.stat().st_mtime > 60:
        raise UsageError(f"{init_method} already exists, left by an earlier job: a file:// path must be new for "
                         f"every job (delete it or pick another name)")


# --------------------------------------------------------------------------- devices


def _lowest_arch() -> tuple[int, int] | None:
    """The oldest GPU generation this torch build has kernels for, as (major, minor): (7, 5) for sm_75."""
    archs = [int(a[3:]) for a in torch.cuda.get_arch_list() if a.startswith("sm_") and a[3:].isdigit()]
    return (min(archs) // 10, min(archs) % 10) if archs else None


_DRIVER_FLOOR = {"13": "580", "12": "525", "11": "450"}


def runtime_report(device: torch.device, backend: str | None = None, procs_per_node: int = 1,
                   gpus_per_process: int = 1) -> str:
    """What a run is about to use, for the first lines a script prints: torch, CUDA, the GPUs seen, this
    run's device and backend, and a NOTE wherever the run is not what a GPU user would expect."""
    gpus = common.usable_gpus()
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    if gpus:
        names = sorted({torch.cuda.get_device_name(i) for i in range(gpus)})
        seen = f"{gpus} GPU(s): {', '.join(names)}"
    else:
        seen = "no CUDA GPU visible"
    run = f"{procs_per_node} process(es) per node on {device.type}" + (f" with {backend}" if backend else "")
    lines = [f"torch {torch.__version__} ({build}), {seen}; this run: {run}"]
    # a run on the CPU although GPUs are visible (too few, too old, or --device cpu) has its NOTE already, from
    # common.device_and_backend, which chose the device
    need = procs_per_node * gpus_per_process
    if device.type == "cuda" and need > gpus:
        lines.append(f"NOTE: {procs_per_node} processes share {gpus} GPU(s) through Gloo (local rank r uses "
                     f"cuda:r % {gpus}): every CUDA code path runs, NCCL does not. For speed, one GPU per process.")
    elif not gpus and not torch.cuda.is_available() and torch.version.cuda and shutil.which("nvidia-smi"):
        floor = _DRIVER_FLOOR.get(torch.version.cuda.split(".")[0], "recent enough")
        lines.append(f"NOTE: nvidia-smi is installed but torch sees no usable GPU, so this run uses the CPU. This "
                     f"torch is built for CUDA {torch.version.cuda}: it needs an NVIDIA driver {floor} or newer "
                     f"(`nvidia-smi` shows yours) and a GPU of compute capability "
                     f"{'.'.join(map(str, _lowest_arch() or ('?',)))} or newer.")
    return "\n".join(lines)


def share_cpu_threads(procs_per_node: int) -> int:
    """Give each of `procs_per_node` CPU processes its share of the cores; return the thread count.

    Every process otherwise starts one thread per core, and N processes fight over the same cores.
    An OMP_NUM_THREADS already in the environment wins, whether you set it or torchrun did (1 for 2+ workers);
    mp.spawn and hand-started processes get no such default.
    """
    if "OMP_NUM_THREADS" in os.environ:
        return torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // max(1, procs_per_node))
    torch.set_num_threads(threads)
    return threads


def batch_loader(dataset: TensorDataset, batch_size: int, sampler=None, shuffle: bool = False, seed: int = 0,
                 drop_last: bool = False, pin_memory: bool = False) -> DataLoader:
    """A DataLoader that fetches each batch with ONE tensor index instead of batch_size __getitem__ calls.

    `sampler` (for example a DistributedSampler) decides which samples; this only groups them.
    """
    if sampler is None:
        sampler = (RandomSampler(dataset, generator=torch.Generator().manual_seed(seed)) if shuffle
                   else SequentialSampler(dataset))
    return DataLoader(dataset, sampler=BatchSampler(sampler, batch_size, drop_last), batch_size=None,
                      pin_memory=pin_memory)


# --------------------------------------------------------------------------- printing


def print0(rank: int, *parts) -> None:
    """Print one whole line, from rank 0 only (other ranks stay quiet)."""
    if rank == 0:
        say(*parts)
