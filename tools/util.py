"""Small helpers of the course's machinery that need neither torch nor common.py: a one-line error, printing a whole
line at once, and atomic file writes. tools/data.py and tools/standins.py use them, so that preparing the data
(which common.prepare_data asks tools/data.py for) imports nothing that imports common.py back."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path


class UsageError(ValueError):
    """A request that cannot work; the message says what to do instead."""


def say(*parts) -> None:
    """Print one line in a single write, so that lines from several processes never mix mid-line.

    (print() writes the text and the newline separately; another process can write in between.)
    """
    sys.stdout.write(" ".join(str(p) for p in parts) + "\n")
    sys.stdout.flush()


def _atomic_write(path, write) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the mode open() would
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


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(data: bytes, path) -> Path:
    """Write `data` to `path` so that a crash mid-write leaves the previous file intact."""
    return _atomic_write(path, lambda f: f.write(data))
