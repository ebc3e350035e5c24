"""The course's own machinery, which no lesson needs: one-line argument errors, the checks the make targets'
preflight makes, the runtime report, printing and parsing of the `kind: key=value` lines, atomic checkpoints,
weight digests. The demos of sections 02-06 and the benchmarks use it; the MNIST chain scripts do not.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import re
import shutil
import sys
import threading
import time
import zlib
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler, TensorDataset
from tqdm import tqdm

import common
from common import CIFAR_DATASETS, MNIST_DATASETS, free_port  # noqa: F401 - re-exported for the demos
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


def local_rank_arg(text: str) -> int:
    """--local-rank as the deprecated torch.distributed.launch passes it: one whole number."""
    if "," in text:
        raise argparse.ArgumentTypeError(f"got {text!r}: torchrun gives every process its own LOCAL_RANK; drop "
                                          f"--local_rank from the command line")
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def accept_local_rank(parser: argparse.ArgumentParser) -> None:
    """--local-rank and --local_rank, which the deprecated torch.distributed.launch passes (2.0 and later, and
    before); a LOCAL_RANK in the environment (torchrun's way) wins. The value is args.local_rank (-1: none)."""
    parser.add_argument("--local-rank", "--local_rank", type=local_rank_arg, default=-1, dest="local_rank",
                        help="set by the deprecated torch.distributed.launch; LOCAL_RANK wins when set")


def check_args(parser: argparse.ArgumentParser, args, *, rank: int = 0, world_size: int = 1, local_rank: int = 0,
               procs_per_node: int = 1) -> tuple[torch.device, str | None]:
    """Check the shared flags and this process's place in the job (PyTorch checks neither the ranks nor a
    file:// --init-method), then choose its device and backend and return them.

    Any mistake ends the program with one line (parser.error) before anything starts: make's preflight
    (tools/preflight.py) runs this once before a launch starts N processes. See choose_device for the choice.
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


def gpu_count() -> int:
    """The CUDA GPUs this process can use (common.usable_gpus)."""
    return common.usable_gpus()


def _too_old_gpus(count: int) -> list[str]:
    """The visible GPUs whose compute capability is below the lowest this build was compiled for."""
    low = _lowest_arch()
    return [f"{torch.cuda.get_device_name(i)} ({'.'.join(map(str, torch.cuda.get_device_capability(i)))})"
            for i in range(count) if low and torch.cuda.get_device_capability(i) < low]


def _lowest_arch() -> tuple[int, int] | None:
    """The oldest GPU generation this torch build has kernels for, as (major, minor): (7, 5) for sm_75."""
    archs = [int(a[3:]) for a in torch.cuda.get_arch_list() if a.startswith("sm_") and a[3:].isdigit()]
    return (min(archs) // 10, min(archs) % 10) if archs else None


def choose_device(device: str = "auto", backend: str | None = "auto", *, local_rank: int = 0,
                  procs_per_node: int = 1) -> tuple[torch.device, str | None]:
    """This process's device and the process group backend, from --device and --backend.

    auto: CUDA + NCCL when the node has a GPU for every process (local rank r uses cuda:r), otherwise
    CPU + Gloo. `--device cuda --backend gloo` with fewer GPUs than processes lets processes share
    GPUs (local rank r uses cuda:r % GPUs): every CUDA code path runs, but not NCCL, which refuses
    two processes on one GPU. backend=None is for single-process scripts. A request that cannot
    work raises UsageError with what to do instead.
    """
    gpus = gpu_count()
    if procs_per_node < 1:
        raise UsageError(f"the number of processes per node must be at least 1, got {procs_per_node}")
    if device == "cuda" and gpus == 0:
        raise UsageError("--device cuda: no usable CUDA GPU is visible here (see the NOTE above); use --device cpu")
    if backend == "nccl":
        if gpus == 0:
            raise UsageError("--backend nccl needs CUDA GPUs and none is visible; use --backend gloo on a CPU machine")
        if device == "cpu":
            raise UsageError("--backend nccl works on CUDA tensors only; drop --device cpu or use --backend gloo")
    wants_nccl = backend == "nccl" or (backend == "auto" and device == "cuda")
    if wants_nccl and procs_per_node > gpus:
        raise UsageError(f"NCCL needs one GPU per process: {procs_per_node} processes per node but {gpus} GPU(s) "
                         f"here. Start at most {gpus} per node (NPROC={gpus}), or add --backend gloo to let "
                         f"processes share GPUs")
    if device == "auto":
        device = "cuda" if 0 < procs_per_node <= gpus else "cpu"
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    if device == "cpu":
        return torch.device("cpu"), backend
    return torch.device("cuda", local_rank % gpus), backend


_DRIVER_FLOOR = {"13": "580", "12": "525", "11": "450"}


def runtime_report(device: torch.device, backend: str | None = None, procs_per_node: int = 1,
                   gpus_per_process: int = 1) -> str:
    """What a run is about to use, for the first lines a script prints: torch, CUDA, the GPUs seen, this
    run's device and backend, and a NOTE wherever the run is not what a GPU user would expect."""
    gpus = gpu_count()
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


# --------------------------------------------------------------------------- checkpoints


def load_checkpoint(path) -> dict:
    """A checkpoint written by atomic_save, loaded onto the CPU with weights_only=True.

    map_location="cpu" keeps RNG states where torch wants them; load_state_dict then copies the
    weights to wherever the model is, and an optimizer moves its state to its parameters' device.
    A damaged file ends in one line (UsageError) that names it; the file is left as it is.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - truncated, random bytes, not a torch file: all the same to a user
        raise UsageError(f"{path} is damaged or not a checkpoint (torch.load: {type(err).__name__}). It was left as "
                         f"it is: move it away, or use another --checkpoint-dir, to start over") from None


def rng_state() -> dict:
    """Python's and torch's RNG states, and this process's current GPU's, in a form that
    torch.load(weights_only=True) accepts. Only the current GPU: the file must load on a machine with fewer."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what rng_state() saved, however the checkpoint was loaded.

    torch.set_rng_state accepts only a CPU ByteTensor ("RNG state must be a torch.ByteTensor"); a
    checkpoint loaded with map_location=<a GPU> has put the saved states on that GPU: .cpu() brings them back.
    """
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())  # the current GPU's


# --------------------------------------------------------------------------- printing, progress, evaluation


def print0(rank: int, *parts) -> None:
    """Print one whole line, from rank 0 only (other ranks stay quiet)."""
    if rank == 0:
        say(*parts)


def progress(iterable, rank: int, desc: str = "", total: int | None = None):
    """A tqdm bar on rank 0; on other ranks the bare iterable."""
    if rank != 0:
        return iterable
    # tqdm's default lock is a multiprocessing semaphore, reported as "leaked" when a worker ends abruptly;
    # only rank 0 draws, so a thread lock is all it needs
    tqdm.set_lock(threading.RLock())
    interactive = sys.stderr.isatty()
    return tqdm(iterable, desc=desc, total=total, leave=False, dynamic_ncols=True,
                mininterval=0.1 if interactive else 5.0, file=sys.stderr)


def line(kind: str, **fields) -> str:
    """One structured output line, `kind: key=value ...`: floats with 4 decimals, everything else as it is.

    Notebooks and tests read these lines with parse_lines; people read them too.
    """
    return f"{kind}: " + " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items())


def weights_digest(model: nn.Module) -> str:
    """A short fingerprint (CRC-32) of every parameter and buffer: equal on two ranks only if the bytes are equal."""
    crc = 0
    for key, tensor in model.state_dict().items():
        crc = zlib.crc32(key.encode(), crc)
        crc = zlib.crc32(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), crc)
    return f"{crc:08x}"


def shard_line(rank: int, epoch: int, sampler) -> str:
    """What this rank trains on in this epoch, in one line: how many samples, their sum and sum of squares
    (equal totals over the ranks mean the shards cover the data set once), and a fingerprint of their order.

    The sampler's own random generator, if it has one, is left as it was: asking does not change the training.
    """
    generator = getattr(sampler, "generator", None)
    saved = generator.get_state() if generator is not None else None
    indices = torch.tensor(list(sampler), dtype=torch.int64)
    if saved is not None:
        generator.set_state(saved)
    order = zlib.crc32(indices.numpy().tobytes())
    return line("shard", rank=rank, epoch=epoch + 1, samples=len(indices), sum=int(indices.sum()),
                sumsq=int((indices * indices).sum()), order=f"{order:08x}")


def worker_error(err: Exception) -> str:
    """What to say about an mp.spawn worker that failed: the one line of a UsageError, else its whole traceback."""
    found = re.search(r"^common\.UsageError: (.*)$", str(err), re.M)
    return f"error: {found.group(1)}" if found else str(err)


# --------------------------------------------------------------------------- files and ports


def atomic_save(obj, path) -> Path:
    """torch.save through a temp file, fsync and os.replace: a killed save never corrupts `path`."""
    return _atomic_write(path, lambda f: torch.save(obj, f))
