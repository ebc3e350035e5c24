"""The boring, non-distributed parts that every script of the course shares.

Models, data sets (real torchvision loaders and offline stand-ins), seeding, device and
backend choice, command-line defaults, rank-0 printing, progress bars, atomic file writes
and free ports. Nothing in this file calls torch.distributed: every line that is about
distribution lives in the numbered script that teaches it.

Copy this file next to any script of the course and the script runs on its own.
"""

from __future__ import annotations

import argparse
import math
import os
import pickle
import random
import re
import shutil
import socket
import struct
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, SequentialSampler, TensorDataset
from tqdm import tqdm

# --------------------------------------------------------------------------- models


class ConvNet(nn.Module):
    """The small MNIST network of the course: two conv + BatchNorm + pool blocks, one linear layer."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.layer1 = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=5, padding=2), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2)
        )
        self.layer2 = nn.Sequential(
            nn.Conv2d(16, 32, kernel_size=5, padding=2), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2)
        )
        self.fc = nn.Linear(7 * 7 * 32, num_classes)

    def forward(self, x):
        x = self.layer2(self.layer1(x))
        return self.fc(x.flatten(1))


class ToyModel(nn.Module):
    """Two linear layers (10 -> 10 -> 5): big enough to have gradients, small enough to print."""

    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


class ToyMpModel(nn.Module):
    """ToyModel split over two devices (model parallelism): net1 on dev0, net2 on dev1."""

    def __init__(self, dev0, dev1):
        super().__init__()
        self.dev0, self.dev1 = torch.device(dev0), torch.device(dev1)
        self.net1 = nn.Linear(10, 10).to(self.dev0)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5).to(self.dev1)

    def forward(self, x):
        x = self.relu(self.net1(x.to(self.dev0)))
        return self.net2(x.to(self.dev1))


def resnet18_cifar(num_classes: int = 10) -> nn.Module:
    """torchvision's ResNet-18 adapted to 32x32 images: a 3x3 stem with stride 1 and no max-pool."""
    from torchvision.models import resnet18

    model = resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


class RandomDataset(Dataset):
    """`length` random vectors of size `features` (the DataParallel shape demo's input)."""

    def __init__(self, length: int, features: int, seed: int = 0):
        self.data = torch.randn(length, features, generator=torch.Generator().manual_seed(seed))

    def __getitem__(self, index):
        return self.data[index]

    def __len__(self):
        return len(self.data)


class RangeDataset(Dataset):
    """The numbers 0 .. length-1 as floats: easy to see which sample went to which rank."""

    def __init__(self, length: int):
        self.data = torch.arange(length, dtype=torch.float32)

    def __getitem__(self, index):
        return self.data[index]

    def __len__(self):
        return len(self.data)


# --------------------------------------------------------------------------- seeding and devices


def seed_everything(seed: int) -> None:
    """Seed Python and torch (every device), and make cuDNN pick deterministic algorithms, so that two
    runs with the same seed compute the same weights (the resume and restart demos compare them bitwise)."""
    random.seed(seed)
    torch.manual_seed(seed)
    torch.backends.cudnn.deterministic = True  # on a GPU; no effect on the CPU
    torch.backends.cudnn.benchmark = False


def share_cpu_threads(procs_per_node: int) -> int:
    """Give each of `procs_per_node` CPU processes its share of the cores; return the thread count.

    Every process otherwise starts one thread per core, and N processes fight over the same
    cores (2.7x slower measured with 2 processes on 2 cores). torchrun sets OMP_NUM_THREADS=1
    for you; mp.spawn and hand-started processes do not. An OMP_NUM_THREADS you set wins.
    """
    if "OMP_NUM_THREADS" in os.environ:
        return torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // max(1, procs_per_node))
    torch.set_num_threads(threads)
    return threads


class UsageError(ValueError):
    """A request that cannot work; the message says what to do instead."""


def gpu_count() -> int:
    """The CUDA GPUs this process can use: 0 without CUDA, without a working driver, or with GPUs older
    than this torch build has kernels for (it would fail at the first operation)."""
    if not torch.cuda.is_available():
        return 0
    count = torch.cuda.device_count()
    return 0 if _too_old_gpus(count) else count


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


# the oldest Linux driver each CUDA major version runs on (NVIDIA's minor-version compatibility table)
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
    need = procs_per_node * gpus_per_process
    if gpus and device.type == "cpu":
        most = gpus // gpus_per_process
        why = (f"{procs_per_node} process(es) per node need {need} GPUs. Start at most {most} per node "
               f"(NPROC={most}), or use --device cuda --backend gloo to let processes share GPUs"
               if need > gpus else "--device cpu was asked for")
        lines.append(f"NOTE: THIS RUN USES THE CPU although {gpus} GPU(s) are visible: {why}.")
    elif device.type == "cuda" and need > gpus:
        lines.append(f"NOTE: {procs_per_node} processes share {gpus} GPU(s) through Gloo (local rank r uses "
                     f"cuda:r % {gpus}): every CUDA code path runs, NCCL does not. For speed, one GPU per process.")
    elif not gpus and torch.cuda.is_available():
        lines.append(f"NOTE: THIS RUN USES THE CPU: this torch build has GPU kernels for compute capability "
                     f"{'.'.join(map(str, _lowest_arch()))} and newer, and these GPUs are older: "
                     f"{', '.join(_too_old_gpus(torch.cuda.device_count()))}. Install a torch build for them "
                     f"(pytorch.org), or keep the CPU.")
    elif not gpus and torch.version.cuda and shutil.which("nvidia-smi"):
        floor = _DRIVER_FLOOR.get(torch.version.cuda.split(".")[0], "recent enough")
        lines.append(f"NOTE: nvidia-smi is installed but torch sees no usable GPU, so this run uses the CPU. This "
                     f"torch is built for CUDA {torch.version.cuda}: it needs an NVIDIA driver {floor} or newer "
                     f"(`nvidia-smi` shows yours) and a GPU of compute capability "
                     f"{'.'.join(map(str, _lowest_arch() or ('?',)))} or newer.")
    return "\n".join(lines)


# --------------------------------------------------------------------------- command line

MNIST_DATASETS = ("auto", "mnist", "mnist-standin")
CIFAR_DATASETS = ("auto", "cifar10", "cifar10-standin")


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
count_or_zero = _number(int, 0, True, "0 (off) or a positive whole number")
positive_float = _number(float, 0.0, False, "a positive number")


def add_common_args(parser: argparse.ArgumentParser, *, family: str = "mnist", epochs: int = 2,
                    batch_size: int = 64, lr: float = 0.01, distributed: bool = True) -> None:
    """The flags every training script shares (see the course README for their meaning).

    Their types check the numbers, so that `--lr nan` or `--epochs -1` end in one line of argparse.
    """
    choices = MNIST_DATASETS if family == "mnist" else CIFAR_DATASETS
    parser.add_argument("--epochs", type=positive_int, default=epochs,
                        help="passes over the training set (default %(default)s)")
    parser.add_argument("--batch-size", type=positive_int, default=batch_size,
                        help="samples per step per process (default %(default)s)")
    parser.add_argument("--lr", type=positive_float, default=lr, help="learning rate (default %(default)s)")
    parser.add_argument("--dataset", default="auto", choices=choices,
                        help="real data, the offline stand-in, or auto: real when present or downloadable")
    parser.add_argument("--data-dir", default="data", help="where data sets live (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default %(default)s)")
    parser.add_argument("--max-steps", type=count_or_zero, default=0,
                        help="stop each epoch after this many steps; 0 = whole epoch (for smoke runs)")
    parser.add_argument("--log-every", type=count_or_zero, default=0,
                        help="print the training loss every N steps (rank 0); 0 = only once per epoch")
    parser.add_argument("--checkpoint-dir", default="",
                        help="write a checkpoint here after every epoch (default: none)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="auto = CUDA when there is a GPU for every process, else CPU")
    if distributed:
        parser.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"),
                            help="auto = NCCL on CUDA, Gloo on CPU")
        parser.add_argument("--timeout", type=positive_float, default=60.0,
                            help="seconds any collective may wait before the job fails (default %(default)s)")


def check_args(parser: argparse.ArgumentParser, args, *, local_rank: int = 0,
               procs_per_node: int = 1) -> tuple[torch.device, str | None]:
    """Check the shared flags, then choose this process's device and backend and return them.

    Any mistake ends the program with one line (parser.error) before anything starts.
    See choose_device for the choice; single-process scripts get backend None.
    """
    data_dir = Path(args.data_dir)
    if data_dir.exists() and not data_dir.is_dir():
        parser.error(f"--data-dir {data_dir} is not a directory")
    if data_dir.exists() and not os.access(data_dir, os.R_OK | os.X_OK):
        parser.error(f"--data-dir {data_dir} is not readable")
    try:
        return choose_device(args.device, getattr(args, "backend", None), local_rank=local_rank,
                             procs_per_node=procs_per_node)
    except UsageError as err:
        parser.error(str(err))


# --------------------------------------------------------------------------- printing


def say(*parts) -> None:
    """Print one line in a single write, so that lines from several processes never mix mid-line.

    (print() writes the text and the newline separately; another process can write in between.)
    """
    sys.stdout.write(" ".join(str(p) for p in parts) + "\n")
    sys.stdout.flush()


def leave(code: int = 0) -> None:
    """End this process at once (flush, then os._exit), skipping the interpreter's teardown.

    With torch 2.14 and Gloo, a worker that finished its work and destroyed its process group
    sometimes still aborts while the process exits ('terminate called without an active
    exception', SIGABRT, with no Python frame left): about 1 run in 10 of a 3-rank script here.
    That turns a successful run into a failed one. Call this last, after destroy_process_group().
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def print0(rank: int, *parts) -> None:
    """Print one whole line, from rank 0 only (other ranks stay quiet)."""
    if rank == 0:
        say(*parts)


def progress(iterable, rank: int, desc: str = "", total: int | None = None):
    """A tqdm bar on rank 0; on other ranks the bare iterable."""
    if rank != 0:
        return iterable
    interactive = sys.stderr.isatty()
    return tqdm(iterable, desc=desc, total=total, leave=False, dynamic_ncols=True,
                mininterval=0.1 if interactive else 5.0, file=sys.stderr)


def final_line(*, test_acc: float, test_samples: int, world_size: int, epochs: int, seconds: float,
               dataset: str, **extra) -> str:
    """The summary every training script prints last, on rank 0; tests parse it."""
    line = (f"final: test_acc={test_acc:.4f} test_samples={test_samples} world_size={world_size} "
            f"epochs={epochs} seconds={seconds:.1f} dataset={dataset}")
    for key, value in extra.items():
        line += f" {key}={value:.4f}" if isinstance(value, float) else f" {key}={value}"
    return line


# --------------------------------------------------------------------------- files and ports


def _atomic_write(path, write) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: readers see the old file or the new one, never half of one
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself survive a power cut
    finally:
        os.close(dir_fd)
    return path


def atomic_write_bytes(data: bytes, path) -> Path:
    """Write `data` to `path` so that a crash mid-write leaves the previous file intact."""
    return _atomic_write(path, lambda f: f.write(data))


def atomic_save(obj, path) -> Path:
    """torch.save through a temp file, fsync and os.replace: a killed save never corrupts `path`."""
    return _atomic_write(path, lambda f: torch.save(obj, f))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it; another program could still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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


def load_checkpoint(path) -> dict:
    """A checkpoint written by atomic_save, loaded onto the CPU with weights_only=True.

    map_location="cpu" keeps RNG states where torch wants them; load_state_dict then copies the
    weights to wherever the model is, and an optimizer moves its state to its parameters' device.
    """
    return torch.load(path, map_location="cpu", weights_only=True)


# --------------------------------------------------------------------------- data: stand-ins

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
STANDIN_SIZES = {"mnist": (24000, 4000), "cifar10": (10000, 2000)}  # (train, test) images
STANDIN_SUBDIR = "standin"

# Digit glyphs, 7 rows x 5 columns, two hand styles each; '#' is ink.
_GLYPHS = {
    0: [" ### ,#   #,#  ##,# # #,##  #,#   #, ### ", " ### ,#   #,#   #,#   #,#   #,#   #, ### "],
    1: ["  #  , ##  ,  #  ,  #  ,  #  ,  #  , ### ", "   # ,  ## , # # ,   # ,   # ,   # ,   # "],
    2: [" ### ,#   #,    #,   # ,  #  , #   ,#####", " ### ,#   #,    #,  ## , #   ,#    ,#####"],
    3: ["#####,   # ,  #  ,   # ,    #,#   #, ### ", " ### ,#   #,    #,  ## ,    #,#   #, ### "],
    4: ["   # ,  ## , # # ,#  # ,#####,   # ,   # ", "#   #,#   #,#   #,#####,    #,    #,    #"],
    5: ["#####,#    ,#### ,    #,    #,#   #, ### ", "#####,#    ,#    ,#### ,    #,    #,#### "],
    6: ["  ## , #   ,#    ,#### ,#   #,#   #, ### ", " ### ,#    ,#    ,#### ,#   #,#   #, ### "],
    7: ["#####,    #,   # ,  #  , #   , #   , #   ", "#####,    #,   # , ### ,  #  ,  #  ,  #  "],
    8: [" ### ,#   #,#   #, ### ,#   #,#   #, ### ", " ### ,#   #, # # ,  #  , # # ,#   #, ### "],
    9: [" ### ,#   #,#   #, ####,    #,   # , ##  ", " ### ,#   #,#   #, ####,    #,    #, ### "],
}


def _glyph_bank() -> torch.Tensor:
    """(10, styles, 1, 7, 5) float tensor of the digit bitmaps."""
    bank = [[[[c == "#" for c in row] for row in style.split(",")] for style in _GLYPHS[d]] for d in range(10)]
    return torch.tensor(bank, dtype=torch.float32).unsqueeze(2)


def make_mnist_standin(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` handwriting-like 28x28 uint8 digits and their labels, deterministic for a seed.

    Each image is a bitmap glyph warped by a random affine map and a smooth random
    displacement field, with random stroke width, blur, clutter and noise: learnable, but
    hard enough that a small ConvNet does not reach 100 % at once.
    """
    g = torch.Generator().manual_seed(seed)
    bank = _glyph_bank()
    labels = torch.randint(0, 10, (n,), generator=g)
    styles = torch.randint(0, bank.shape[1], (n,), generator=g)
    images = torch.empty(n, 28, 28, dtype=torch.uint8)
    for start in range(0, n, 4096):
        sl = slice(start, min(n, start + 4096))
        m = sl.stop - sl.start
        glyph = bank[labels[sl], styles[sl]]  # (m, 1, 7, 5)
        canvas = F.pad(F.interpolate(glyph, size=(20, 14), mode="bilinear", align_corners=False), (7, 7, 4, 4))
        thick = torch.rand(m, generator=g) < 0.5  # bolder pen for half of them
        canvas = torch.where(thick.view(m, 1, 1, 1), F.max_pool2d(canvas, 3, 1, 1), canvas)
        angle = (torch.rand(m, generator=g) - 0.5) * math.radians(40)
        scale = 0.8 + 0.4 * torch.rand(m, generator=g)
        shear = (torch.rand(m, generator=g) - 0.5) * 0.6
        shift = (torch.rand(m, 2, generator=g) - 0.5) * 0.35
        cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
        theta = torch.stack([torch.stack([cos, -sin + shear, shift[:, 0]], 1),
                             torch.stack([sin, cos, shift[:, 1]], 1)], 1)
        grid = F.affine_grid(theta, (m, 1, 28, 28), align_corners=False)
        wobble = F.interpolate(torch.randn(m, 2, 4, 4, generator=g) * 0.08, size=(28, 28), mode="bicubic",
                               align_corners=False).permute(0, 2, 3, 1)
        img = F.grid_sample(canvas, grid + wobble, mode="bilinear", padding_mode="zeros", align_corners=False)
        # clutter: a stray stroke in a third of the images
        stray = torch.zeros(m, 1, 28, 28)
        rows = torch.randint(0, 28, (m,), generator=g)
        cols = torch.randint(0, 20, (m,), generator=g)
        has = torch.rand(m, generator=g) < 0.33
        for k in range(6):
            stray[torch.arange(m), 0, rows, (cols + k).clamp(max=27)] = has.float() * 0.8
        img = torch.maximum(img, stray)
        img = F.avg_pool2d(F.pad(img, (1, 1, 1, 1), mode="replicate"), 3, 1) * 0.6 + img * 0.4  # soft ink
        img = img * (0.6 + 0.4 * torch.rand(m, 1, 1, 1, generator=g)) + 0.12 * torch.randn(img.shape, generator=g)
        images[sl] = (img.clamp(0, 1) * 255).round().to(torch.uint8).squeeze(1)
    return images, labels


def make_cifar_standin(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` 32x32 RGB uint8 images (N, 32, 32, 3) of ten procedural classes, and labels.

    Each class is a shape or texture (disc, square, ring, cross, stripes, checks, ...) with
    random colour, size, position, background and noise.
    """
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    yy, xx = torch.meshgrid(torch.linspace(-1, 1, 32), torch.linspace(-1, 1, 32), indexing="ij")
    cx, cy = [(torch.rand(n, 1, 1, generator=g) - 0.5) * 0.8 for _ in range(2)]
    r = 0.35 + 0.3 * torch.rand(n, 1, 1, generator=g)
    x, y = xx - cx, yy - cy
    freq = 6 + 6 * torch.rand(n, 1, 1, generator=g)
    masks = torch.stack([
        (x**2 + y**2 < r**2).float(),                                          # disc
        ((x.abs() < r) & (y.abs() < r)).float(),                               # square
        ((x**2 + y**2 < r**2) & (x**2 + y**2 > (0.6 * r) ** 2)).float(),       # ring
        (((x.abs() < r / 4) & (y.abs() < r)) | ((y.abs() < r / 4) & (x.abs() < r))).float(),  # cross
        (torch.sin(freq * yy) > 0).float(),                                    # horizontal stripes
        (torch.sin(freq * xx) > 0).float(),                                    # vertical stripes
        (torch.sin(freq * (xx + yy) / 1.4) > 0).float(),                       # diagonal stripes
        ((torch.sin(freq * xx) > 0) ^ (torch.sin(freq * yy) > 0)).float(),     # checks
        ((y > -r) & (y < r) & (x.abs() < (y + r) / 2)).float(),                # triangle
        ((x.abs() + y.abs()) < r).float(),                                     # diamond
    ], 1)
    mask = masks[torch.arange(n), labels].unsqueeze(1)  # (n, 1, 32, 32)
    fg = torch.rand(n, 3, 1, 1, generator=g)
    bg = torch.rand(n, 3, 1, 1, generator=g)
    bg = torch.where((fg - bg).abs().sum(1, keepdim=True) < 0.6, 1 - fg, bg)  # keep the shape visible
    img = mask * fg + (1 - mask) * bg + 0.1 * torch.randn(n, 3, 32, 32, generator=g)
    img = (img.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()
    return img, labels


def _idx_bytes(t: torch.Tensor) -> bytes:
    """A uint8 tensor in MNIST's IDX format (magic 0x0000080N, big-endian sizes, raw bytes)."""
    header = struct.pack(">HBB", 0, 0x08, t.dim()) + struct.pack(f">{t.dim()}I", *t.shape)
    return header + t.numpy().tobytes()


def write_mnist_standin(root, sizes=None, seed: int = 1234) -> Path:
    """Write the MNIST stand-in as IDX files under root/MNIST/raw (where torchvision.datasets.MNIST looks)."""
    raw = Path(root) / "MNIST" / "raw"
    n_train, n_test = sizes or STANDIN_SIZES["mnist"]
    for prefix, n, s in (("train", n_train, seed), ("t10k", n_test, seed + 1)):
        images, labels = make_mnist_standin(n, s)
        atomic_write_bytes(_idx_bytes(images), raw / f"{prefix}-images-idx3-ubyte")
        atomic_write_bytes(_idx_bytes(labels.to(torch.uint8)), raw / f"{prefix}-labels-idx1-ubyte")
    return raw


CIFAR_CLASSES = ["disc", "square", "ring", "cross", "h-stripes", "v-stripes", "d-stripes", "checks",
                 "triangle", "diamond"]
CIFAR_STANDIN_FOLDER = "cifar-10-standin-py"


def write_cifar_standin(root, sizes=None, seed: int = 4321) -> Path:
    """Write the CIFAR-10 stand-in as pickled batches, in CIFAR-10's own python format."""
    folder = Path(root) / CIFAR_STANDIN_FOLDER
    n_train, n_test = sizes or STANDIN_SIZES["cifar10"]
    train_x, train_y = make_cifar_standin(n_train, seed)
    test_x, test_y = make_cifar_standin(n_test, seed + 1)

    def batch(x, y, name):  # CIFAR rows are 3072 bytes: the R plane, then G, then B
        return {"batch_label": name, "labels": y.tolist(), "data": x.permute(0, 3, 1, 2).reshape(len(x), -1).numpy(),
                "filenames": [f"{name}_{i}.png" for i in range(len(x))]}

    for i, part in enumerate(torch.arange(n_train).chunk(5)):
        atomic_write_bytes(pickle.dumps(batch(train_x[part], train_y[part], f"training batch {i + 1} of 5")),
                           folder / f"data_batch_{i + 1}")
    atomic_write_bytes(pickle.dumps(batch(test_x, test_y, "testing batch 1 of 1")), folder / "test_batch")
    meta = {"label_names": CIFAR_CLASSES, "num_cases_per_batch": n_train // 5, "num_vis": 3072}
    atomic_write_bytes(pickle.dumps(meta), folder / "batches.meta")
    return folder


_cifar_standin_cls = None


def cifar10_standin_class():
    """torchvision's CIFAR10 loader pointed at the stand-in files (no md5 check: they are generated).

    Built on first use so that importing common does not import torchvision (about 1 s).
    """
    global _cifar_standin_cls
    if _cifar_standin_cls is None:
        from torchvision.datasets import CIFAR10

        class CIFAR10StandIn(CIFAR10):
            base_folder = CIFAR_STANDIN_FOLDER
            train_list = [[f"data_batch_{i}", None] for i in range(1, 6)]
            test_list = [["test_batch", None]]
            meta = {"filename": "batches.meta", "key": "label_names", "md5": None}

        _cifar_standin_cls = CIFAR10StandIn
    return _cifar_standin_cls


# --------------------------------------------------------------------------- data: loading


def _real_present(family: str, data_dir) -> bool:
    d = Path(data_dir)
    if family == "mnist":
        return all((d / "MNIST" / "raw" / f).exists() for f in
                   ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                    "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"))
    return (d / "cifar-10-batches-py" / "test_batch").exists()


def _standin_present(family: str, data_dir) -> bool:
    root = Path(data_dir) / STANDIN_SUBDIR
    if family == "mnist":
        return (root / "MNIST" / "raw" / "t10k-labels-idx1-ubyte").exists()
    return (root / CIFAR_STANDIN_FOLDER / "batches.meta").exists()


def family_of(dataset: str) -> str:
    return "mnist" if dataset.startswith("mnist") else "cifar10"


def prepare_data(dataset: str, data_dir, family: str = "mnist", quiet: bool = False) -> str:
    """Make sure the data exists on disk; return the concrete data set name used.

    Call it from ONE process (rank 0, or the parent before spawning) while the others wait:
    it may download or generate files. `auto` takes real data when it is present or can be
    downloaded, otherwise the offline stand-in, and says so loudly.
    """
    if dataset != "auto":
        family = family_of(dataset)
    if dataset == "auto":
        if _real_present(family, data_dir):
            return family
        reason = try_download(family, data_dir, quiet=True)
        if reason is None:
            return family
        if not quiet:
            print(f"NOTE: using the offline {family} STAND-IN, not the real data set "
                  f"({family} not in {data_dir} and the download failed: {reason}). "
                  f"With internet, run `make data` once for the real one.", flush=True)
        dataset = f"{family}-standin"
    if dataset.endswith("-standin"):
        if not _standin_present(family, data_dir):
            t0 = time.time()
            (write_mnist_standin if family == "mnist" else write_cifar_standin)(Path(data_dir) / STANDIN_SUBDIR)
            if not quiet:
                print(f"generated the {dataset} in {Path(data_dir) / STANDIN_SUBDIR} ({time.time() - t0:.1f} s)",
                      flush=True)
        return dataset
    if not _real_present(family, data_dir):
        reason = try_download(family, data_dir, quiet=quiet)
        if reason is not None:
            raise UsageError(f"--dataset {dataset}: not found in {data_dir} and the download failed ({reason}). "
                             f"Connect to the internet and run `make data`, or use --dataset {family}-standin.")
    return dataset


def resolve_dataset(dataset: str, data_dir, family: str = "mnist") -> str:
    """The concrete name `auto` stands for, once prepare_data has run somewhere (no downloads here)."""
    if dataset != "auto":
        return dataset
    return family if _real_present(family, data_dir) else f"{family}-standin"


def try_download(family: str, data_dir, quiet: bool = False) -> str | None:
    """Download the real data set with torchvision; None on success, else the reason it failed."""
    from torchvision import datasets

    cls = datasets.MNIST if family == "mnist" else datasets.CIFAR10
    old_timeout = socket.getdefaulttimeout()
    socket.setdefaulttimeout(20)  # a blocked network should fail, not hang
    try:
        if quiet:
            import contextlib
            import io

            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                for train in (True, False):
                    cls(str(data_dir), train=train, download=True)
        else:
            for train in (True, False):
                cls(str(data_dir), train=train, download=True)
        return None
    except Exception as err:  # noqa: BLE001 - any failure means: fall back or explain
        words = " ".join(str(err).split()) or "no detail"
        inner = re.search(r"<urlopen error ([^>]*)>", words)  # torchvision wraps the network error
        return inner.group(1) if inner else f"{type(err).__name__}: {words[:160]}"
    finally:
        socket.setdefaulttimeout(old_timeout)


def load_dataset(dataset: str, data_dir, train: bool) -> TensorDataset:
    """The whole split as normalised tensors in memory (no per-sample PIL work while training).

    Reads through torchvision's own MNIST / CIFAR10 classes, for real data and stand-ins alike.
    """
    from torchvision import datasets

    family = family_of(dataset)
    root = Path(data_dir) / STANDIN_SUBDIR if dataset.endswith("-standin") else Path(data_dir)
    if family == "mnist":
        ds = datasets.MNIST(str(root), train=train, download=False)
        x = (ds.data.float().div_(255).sub_(MNIST_MEAN).div_(MNIST_STD)).unsqueeze(1)
        y = ds.targets.long()
    else:
        cls = cifar10_standin_class() if dataset.endswith("-standin") else datasets.CIFAR10
        ds = cls(str(root), train=train, download=False)
        x = torch.from_numpy(ds.data).permute(0, 3, 1, 2).float().div_(255)
        x = (x - torch.tensor(CIFAR_MEAN).view(1, 3, 1, 1)) / torch.tensor(CIFAR_STD).view(1, 3, 1, 1)
        y = torch.tensor(ds.targets, dtype=torch.long)
    return TensorDataset(x.contiguous(), y)


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


def augment_cifar(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """CIFAR's standard augmentation for a whole batch at once: random 32x32 crop of the image padded
    by 4 pixels, and a horizontal flip half of the time. One indexing operation, no per-image loop."""
    n, c, h, w = x.shape
    padded = F.pad(x, (4, 4, 4, 4))
    top = torch.randint(0, 9, (n,), generator=generator).to(x.device)
    left = torch.randint(0, 9, (n,), generator=generator).to(x.device)
    rows = (top.view(n, 1) + torch.arange(h, device=x.device)).view(n, 1, h, 1)
    cols = (left.view(n, 1) + torch.arange(w, device=x.device)).view(n, 1, 1, w)
    out = padded[torch.arange(n, device=x.device).view(n, 1, 1, 1), torch.arange(c, device=x.device).view(1, c, 1, 1),
                 rows, cols]
    flip = (torch.rand(n, generator=generator) < 0.5).to(x.device).view(n, 1, 1, 1)
    return torch.where(flip, out.flip(3), out)


@torch.no_grad()
def evaluate(model: nn.Module, loader, device) -> torch.Tensor:
    """Local sums over `loader`: tensor([correct, samples, loss_sum]) in float64 on `device`.

    Sums, not means, so that several processes can add theirs up and divide once.
    """
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        out = model(x)
        totals[0] += (out.argmax(1) == y).sum()
        totals[1] += y.numel()
        totals[2] += F.cross_entropy(out, y, reduction="sum")
    model.train(was_training)
    return totals
