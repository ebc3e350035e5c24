"""The replaceable parts a training script of the course calls: its flags, its device, the data set, the model
and the evaluation sums. In your own project you replace load_dataset and ConvNet with your data and model
(README: "Use a script in your own project"); the rest is plain PyTorch you may keep or drop.

Nothing in this file calls torch.distributed: every line about distribution lives in the numbered script that
teaches it. Downloads, the offline stand-ins and `--dataset auto` live in tools/data.py, which only
prepare_data opens.
"""

from __future__ import annotations

import argparse
import pickle
import random
import socket
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

MNIST_DATASETS = ("auto", "mnist", "mnist-standin")
CIFAR_DATASETS = ("auto", "cifar10", "cifar10-standin")


def add_training_flags(parser: argparse.ArgumentParser, *, datasets=MNIST_DATASETS, epochs: int = 2,
                       batch_size: int = 64, lr: float = 0.01) -> argparse.ArgumentParser:
    """The flags every training script of the course shares; the source notes' spellings work as aliases."""
    parser.add_argument("--epochs", "--num_epochs", "-e", type=int, default=epochs,
                        help="passes over the training set (default %(default)s)")
    parser.add_argument("--batch-size", "--batch_size", "-b", type=int, default=batch_size,
                        help="samples per step PER PROCESS (default %(default)s)")
    parser.add_argument("--lr", "--learning_rate", type=float, default=lr, help="learning rate (default %(default)s)")
    parser.add_argument("--dataset", default="auto", choices=datasets,
                        help="real data, the offline stand-in, or auto: real when present or downloadable")
    parser.add_argument("--data-dir", default="data", help="where data sets live (default %(default)s)")
    parser.add_argument("--seed", "--random_seed", type=int, default=0, help="random seed (default %(default)s)")
    parser.add_argument("--max-steps", type=int, default=0,
                        help="end each epoch after this many steps; 0 = the whole epoch (smoke runs, CI)")
    parser.add_argument("--log-every", type=int, default=0, help="print the loss every N steps; 0 = once per epoch")
    parser.add_argument("--checkpoint-dir", "--model_dir", default="",
                        help="save a checkpoint here after every epoch, and continue from it (default: none)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="auto = CUDA when there is a GPU for every process on this machine, else CPU")
    parser.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"),
                        help="auto = NCCL on CUDA, Gloo on CPU")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds a collective may wait before the job fails (default %(default)s)")
    return parser


# --------------------------------------------------------------------------- device


def usable_gpus() -> int:
    """The CUDA GPUs this process can use: 0 without CUDA or a working driver, and 0 when the GPUs are older
    than this torch build has kernels for (their first operation would fail)."""
    if not torch.cuda.is_available():
        return 0
    return 0 if too_old_gpus() else torch.cuda.device_count()


def too_old_gpus() -> list[str]:
    """The visible GPUs whose compute capability is below the lowest this build was compiled for."""
    archs = [int(a[3:]) for a in torch.cuda.get_arch_list() if a.startswith("sm_") and a[3:].isdigit()]
    low = (min(archs) // 10, min(archs) % 10) if archs else None
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())
            if low and torch.cuda.get_device_capability(i) < low]


def device_and_backend(device: str = "auto", backend: str = "auto", local_rank: int = 0,
                       procs_per_node: int = 1) -> tuple[torch.device, str]:
    """This process's device and the process group's backend, from --device and --backend.

    auto: cuda:LOCAL_RANK and NCCL when this machine has a GPU for every process on it, else the CPU and Gloo.
    `--device cuda --backend gloo` with fewer GPUs than processes lets processes share GPUs (cuda:r % GPUs);
    NCCL refuses that, and the CPU: asked for either way, it is a RuntimeError here, before any process group.
    A run that leaves GPUs unused says so loudly, once per machine.
    """
    gpus = usable_gpus()
    if device == "cuda" and gpus == 0:
        raise RuntimeError("--device cuda: no usable CUDA GPU here; use --device cpu")
    if backend == "nccl" and gpus == 0:
        raise RuntimeError("--backend nccl needs CUDA GPUs and none is usable here; use --backend gloo")
    if backend == "nccl" and device == "cpu":
        raise RuntimeError("--backend nccl works on CUDA tensors only; drop --device cpu or use --backend gloo")
    if (backend == "nccl" or (backend == "auto" and device == "cuda")) and procs_per_node > gpus:
        raise RuntimeError(f"NCCL needs one GPU per process: {procs_per_node} processes on this machine, {gpus} "
                           f"usable GPU(s); start at most {gpus} (NPROC={gpus}), or add --backend gloo to let "
                           f"processes share GPUs")
    if device == "auto":
        device = "cuda" if 0 < procs_per_node <= gpus else "cpu"
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    if device == "cpu" and torch.cuda.is_available() and local_rank == 0:
        why = (f"these GPUs are older than this torch build supports: {', '.join(too_old_gpus())}" if not gpus
               else f"{procs_per_node} processes on this machine, {gpus} GPU(s): at most one process per GPU"
               if procs_per_node > gpus else "--device cpu")
        print(f"NOTE: THIS RUN USES THE CPU although CUDA GPUs are visible ({why}).", flush=True)
    return (torch.device("cuda", local_rank % gpus) if device == "cuda" else torch.device("cpu")), backend


def seed_everything(seed: int) -> None:
    """Seed Python and torch on every device, and ask cuDNN for deterministic kernels: the same seed gives the
    same weights, which the resume and restart demos compare bit for bit."""
    random.seed(seed)
    torch.manual_seed(seed)
    torch.backends.cudnn.deterministic = True  # on a GPU; no effect on the CPU
    torch.backends.cudnn.benchmark = False


_GIVEN: set[int] = set()  # the ports free_port handed out in this process


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free now, for rank 0's store to listen on a moment later.

    Not one the OS hands out (bind to port 0): those come from its range of automatic ports, which it also gives to
    every other socket bound to port 0 (Gloo's listeners, another job's free port) and to outgoing connections, so
    one can take it before rank 0 listens. A random free port below that range can only be taken by a program that
    asks for that very number; this process never hands out the same one twice (jobs started side by side)."""
    low = 32768  # Linux's default start of the range; /proc says where it starts here
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    pick = random.SystemRandom()  # not the seeded `random`: every run, and every test, its own port
    for _ in range(50 if low > 11000 else 0):
        port = pick.randrange(10000, low)
        if port in _GIVEN:  # a job started a moment ago may not listen on it yet
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            _GIVEN.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a range set unusually low: the OS's choice
        s.bind((host, 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- data


MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def prepare_data(dataset: str, data_dir, family: str = "mnist", download: bool = True) -> str:
    """Make sure the data set is on disk and return its concrete name ("auto" becomes "mnist" or "mnist-standin").

    With download=True, run it in ONE process per machine while the others wait: it may download or write
    files. With download=False it only names what is there. The course's version (tools/data.py) knows the
    offline stand-ins and `auto`; a copy of this file without it downloads the real data set with torchvision.
    """
    try:
        from tools import data
    except ModuleNotFoundError as err:  # copied into another project: the real data set only
        if err.name not in ("tools", "tools.data"):
            raise
        name = family if dataset == "auto" else dataset
        if name.endswith("-standin"):  # the course's tools/ write the stand-ins: one whose files are here works
            root = Path(data_dir) / "standin"
            files = ([root / "MNIST/raw" / f"{s}-{k}-ubyte" for s in ("train", "t10k") for k in ("images-idx3",
                      "labels-idx1")] if name.startswith("mnist") else
                     [root / "cifar-10-standin-py" / f for f in ("test_batch", *(f"data_batch_{i}" for i in "12345"))])
            if not all(f.is_file() for f in files):
                raise RuntimeError(f"--dataset {name}: not in {root}. The stand-in is written by the course's tools/; "
                                   f"copy its files or use --dataset {name.split('-')[0]}") from None
            return name
        if download:
            from torchvision import datasets

            Path(data_dir).mkdir(parents=True, exist_ok=True)
            with open(Path(data_dir) / ".download.lock", "a") as lock:
                try:  # machines sharing data_dir download in turns (torchvision's download is not atomic)
                    import fcntl

                    fcntl.flock(lock, fcntl.LOCK_EX)
                except (ImportError, OSError):  # Windows, or a file system without flock: no turns
                    pass
                for train in (True, False):
                    {"mnist": datasets.MNIST, "cifar10": datasets.CIFAR10}[name](str(data_dir), train=train,
                                                                                 download=True)
        return name
    return data.prepare(dataset, data_dir, family) if download else data.resolve_dataset(dataset, data_dir, family)


def load_dataset(dataset: str, data_dir, train: bool) -> TensorDataset:
    """A whole split as an ordinary map-style Dataset: dataset[i] is (image tensor, label), normalised.

    It reads the files as torchvision downloads them (MNIST's IDX files, CIFAR-10's pickled batches; the
    stand-ins use the same formats in DATA_DIR/standin) into memory once, so no per-sample PIL work slows the
    training down.
    """
    root = Path(data_dir) / ("standin" if dataset.endswith("-standin") else "")
    if dataset.startswith("mnist"):
        prefix = "train" if train else "t10k"
        images = _read_idx(root / "MNIST" / "raw" / f"{prefix}-images-idx3-ubyte")  # (N, 28, 28) uint8
        y = _read_idx(root / "MNIST" / "raw" / f"{prefix}-labels-idx1-ubyte").long()
        x = images.float().div_(255).sub_(MNIST_MEAN).div_(MNIST_STD).unsqueeze(1)
    else:
        folder = root / ("cifar-10-standin-py" if dataset.endswith("-standin") else "cifar-10-batches-py")
        rows, labels = [], []
        for name in [f"data_batch_{i}" for i in range(1, 6)] if train else ["test_batch"]:
            with open(folder / name, "rb") as f:
                entry = pickle.load(f, encoding="latin1")  # a dict: "data" (N x 3072 uint8: R, G, B planes)
            rows.append(torch.from_numpy(entry["data"]))
            labels += entry["labels"]
        x = torch.cat(rows).view(-1, 3, 32, 32).float().div_(255)
        x = (x - torch.tensor(CIFAR_MEAN).view(1, 3, 1, 1)) / torch.tensor(CIFAR_STD).view(1, 3, 1, 1)
        y = torch.tensor(labels, dtype=torch.long)
    return TensorDataset(x.contiguous(), y)


def _read_idx(path: Path) -> torch.Tensor:
    """An IDX file of unsigned bytes (MNIST's format): magic 0x0000080N, N big-endian sizes, then the data."""
    data = path.read_bytes()
    if data[:3] != b"\x00\x00\x08":
        raise ValueError(f"{path}: not an IDX file of unsigned bytes")
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(data[3])]
    return torch.frombuffer(bytearray(data[4 + 4 * len(dims):]), dtype=torch.uint8).view(*dims)


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


def resnet18_cifar(num_classes: int = 10) -> nn.Module:
    """torchvision's ResNet-18 adapted to 32x32 images: a 3x3 stem with stride 1 and no max-pool."""
    from torchvision.models import resnet18

    model = resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


# --------------------------------------------------------------------------- evaluation


@torch.no_grad()  # no graph: evaluation keeps no activations for a backward that never comes
def evaluate(model: nn.Module, loader, device) -> torch.Tensor:
    """Sums over `loader`: tensor([correct, samples, loss_sum]) in float64 on `device`.

    Sums, not means, so that several processes can add theirs up and divide once.
    """
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        out = model(x)
        y = y.to(out.device)  # nn.DataParallel gathers the outputs on its output_device, maybe another GPU
        totals[0] += (out.argmax(1) == y).sum().to(device)
        totals[1] += y.numel()
        totals[2] += F.cross_entropy(out, y, reduction="sum").to(device)
    model.train(was_training)
    return totals
