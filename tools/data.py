"""The course's data machinery, which no lesson opens: downloads, the offline stand-ins, `--dataset auto`.

common.prepare_data calls prepare() here. One process per machine runs it (the make targets' preflight, or local
rank 0 while the others wait at a barrier); it may download or generate files.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import time
from pathlib import Path

from tools import standins
from tools.standins import CIFAR_STANDIN_FOLDER, STANDIN_MANIFEST  # noqa: F401 - data.NAME for the tests
from tools.util import UsageError, atomic_write_bytes, say

try:
    import fcntl
except ImportError:  # Windows: no flock; one machine per data folder there
    fcntl = None

STANDIN_SUBDIR = "standin"  # the offline stand-ins live in DATA_DIR/standin (standins.py writes them)

REAL_FILES = {"mnist": [f"MNIST/raw/{split}-{kind}" for split in ("train", "t10k")
                         for kind in ("images-idx3-ubyte", "labels-idx1-ubyte")],
              "cifar10": [f"cifar-10-batches-py/{name}" for name in
                          ("batches.meta", "test_batch", *(f"data_batch_{i}" for i in range(1, 6)))]}

OFFLINE_MEMORY_S = 3600  # after a failed download, `auto` does not try again for an hour


LOCK = ".download.lock"  # in DATA_DIR: one prepare() at a time, also across nodes that share the folder


def prepare(dataset: str, data_dir, family: str = "mnist", quiet: bool = False) -> str:
    """Make sure the data exists on disk; return the concrete data set name used.

    Call it from ONE process per machine (local rank 0, or the parent before spawning) while the others
    wait: it may download or generate files. `auto` takes real data when it is present or can be
    downloaded, otherwise the offline stand-in, and says so loudly. A missing or damaged stand-in file is
    written again; a folder that cannot be written, or real data that cannot be had, ends in one line
    (UsageError) saying what to do. Several machines sharing DATA_DIR (a cluster's shared file system) take
    turns: torchvision's downloads are not atomic, so the second waits for the first, then finds the data.
    """
    with locked(data_dir):
        return _prepare(dataset, data_dir, family, quiet)


@contextlib.contextmanager
def locked(data_dir):
    """Hold an exclusive lock on DATA_DIR/.download.lock. Where there is none to be had (a read-only folder, a file
    system without flock), go on without: the checks that follow then say what is wrong, or find the data."""
    try:
        Path(data_dir).mkdir(parents=True, exist_ok=True)
        lock = open(Path(data_dir) / LOCK, "a")  # noqa: SIM115 - closed below, which also releases the lock
    except OSError:
        lock = None
    with lock or contextlib.nullcontext():
        if lock and fcntl:
            with contextlib.suppress(OSError):
                fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _prepare(dataset: str, data_dir, family: str, quiet: bool) -> str:
    if dataset != "auto":
        family = family_of(dataset)
    data_dir = Path(data_dir)
    if dataset == "auto":
        if not _missing_real(family, data_dir):
            return family
        _check_writable(data_dir, f"the {family} data")
        reason = _recent_download_failure(family, data_dir)
        if reason is None:
            reason = try_download(family, data_dir, quiet=True)
            if reason is None:
                return family
            _remember_download_failure(family, data_dir, reason)
        if not quiet:
            say(f"NOTE: using the offline {family} STAND-IN, not the real data set ({family} not in {data_dir} "
                f"and the download failed: {reason}). With internet, run `make data` once for the real one.")
        dataset = f"{family}-standin"
    if dataset.endswith("-standin"):
        damage = _standin_damage(family, data_dir)
        if damage:
            _check_writable(data_dir, f"the {dataset}")
            t0 = time.time()
            try:
                (standins.write_mnist_standin if family == "mnist" else standins.write_cifar_standin)(
                    data_dir / STANDIN_SUBDIR)
            except OSError as err:
                raise UsageError(f"--data-dir {data_dir}: cannot write the {dataset} there "
                                 f"({err.strerror or err}); use a writable --data-dir") from None
            if not quiet:
                why = "" if damage == "not generated yet" else f"; the old one was damaged ({damage})"
                say(f"generated the {dataset} in {data_dir / STANDIN_SUBDIR}{why} ({time.time() - t0:.1f} s)")
        return dataset
    missing = _missing_real(family, data_dir)
    if missing:
        _check_writable(data_dir, f"the {dataset} data")
        reason = try_download(family, data_dir, quiet=quiet)
        if reason is not None:
            what = "not found" if len(missing) == len(REAL_FILES[family]) else f"{data_dir / missing[0]} is missing"
            raise UsageError(f"--dataset {dataset}: {what} in {data_dir} and the download failed ({reason}). "
                             f"Connect to the internet and run `make data`, or use --dataset {family}-standin.")
    return dataset


def resolve_dataset(dataset: str, data_dir, family: str = "mnist") -> str:
    """The concrete name `auto` stands for, once prepare_data has run somewhere (no downloads here)."""
    if dataset != "auto":
        return dataset
    return family if not _missing_real(family, data_dir) else f"{family}-standin"


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


def family_of(dataset: str) -> str:
    return "mnist" if dataset.startswith("mnist") else "cifar10"


def _missing_real(family: str, data_dir) -> list[str]:
    """The files of the real data set that are not in data_dir (all of them when it was never downloaded)."""
    return [f for f in REAL_FILES[family] if not (Path(data_dir) / f).is_file()]


def _standin_folder(family: str, data_dir) -> Path:
    root = Path(data_dir) / STANDIN_SUBDIR
    return root / "MNIST" / "raw" if family == "mnist" else root / CIFAR_STANDIN_FOLDER


def _standin_damage(family: str, data_dir) -> str | None:
    """None when the stand-in is complete; else what is wrong with it ("not generated yet", a file's size...)."""
    folder = _standin_folder(family, data_dir)
    try:
        sizes = json.loads((folder / STANDIN_MANIFEST).read_text())
    except (OSError, ValueError):
        return "not generated yet" if not folder.exists() else "incomplete: no manifest"
    for name, size in sizes.items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != size:
            return f"{path} has {path.stat().st_size} bytes, not {size}"
    return None


def _check_writable(data_dir: Path, what: str) -> None:
    """--data-dir must exist (or be creatable) and be writable before anything is downloaded or written there."""
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"--data-dir {data_dir} cannot be created ({err.strerror or err}), and {what} must be "
                         f"written there; use a writable --data-dir") from None
    if not os.access(data_dir, os.W_OK | os.X_OK):
        raise UsageError(f"--data-dir {data_dir} is not writable, and {what} must be written there "
                         f"(it is not there yet); use a writable --data-dir")


def _failure_note(family: str, data_dir) -> Path:
    return Path(data_dir) / STANDIN_SUBDIR / f".{family}-download-failed"


def _recent_download_failure(family: str, data_dir) -> str | None:
    """The reason of a failed download of the last hour, so that `auto` does not wait for the network each run."""
    note = _failure_note(family, data_dir)
    try:
        if time.time() - note.stat().st_mtime < OFFLINE_MEMORY_S:
            return f"{note.read_text().strip()}; not retried for an hour: delete {note} to retry now"
    except OSError:
        pass
    return None


def _remember_download_failure(family: str, data_dir, reason: str) -> None:
    try:
        atomic_write_bytes(reason.encode(), _failure_note(family, data_dir))
    except OSError:
        pass  # a read-only data folder: try again next time
