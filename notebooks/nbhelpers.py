"""Helpers for the notebooks: run a course command as a subprocess and fail the cell if it fails.

Notebooks never use `!cmd` (a failing `!cmd` does not fail its cell) nor mp.spawn of a function
defined in a cell (the child processes cannot import it). They call run() instead.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

REPO = next(p for p in [Path.cwd(), *Path.cwd().parents] if (p / "common.py").exists())
PYTHON = sys.executable


def run(cmd, timeout: float = 600, quiet: bool = False) -> str:
    """Run `cmd` (a list, or a string split like a shell would) from the repo root.

    Prints its standard output (unless quiet) and returns it; raises with the tail of the
    error output if the command fails, so the cell fails too.
    """
    if isinstance(cmd, str):
        cmd = shlex.split(cmd)
    cmd = [PYTHON if c == "python" else str(c) for c in cmd]
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if not quiet:
        print(proc.stdout, end="")
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.stdout


def final(output: str) -> dict:
    """The `final:` summary line of a run as a dict of strings."""
    line = [ln for ln in output.splitlines() if ln.startswith("final: ")][-1]
    return dict(pair.split("=", 1) for pair in line[len("final: "):].split())
