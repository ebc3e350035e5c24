"""Run course commands the way a user would, in a subprocess, and check what they leave behind.

Every command gets an outer timeout, its own session (so that everything it starts can be
found again), its whole output captured, and a check that no process of its session outlives it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
TORCHRUN = [PYTHON, "-m", "torch.distributed.run"]


@dataclass
class Result:
    cmd: list
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    final: dict = field(default_factory=dict)

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def tail(self, chars: int = 4000) -> str:
        return f"$ {' '.join(map(str, self.cmd))}\n(exit {self.returncode})\n{self.output[-chars:]}"


def session_processes(sid: int) -> list[int]:
    """PIDs of live (non-zombie) processes whose session id is `sid`, read from /proc."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # the command name may contain spaces and parentheses
        state, session = fields[0], int(fields[3])
        if session == sid and state != "Z":
            pids.append(int(entry.name))
    return pids


def parse_final(text: str) -> dict:
    """The last `final: key=value ...` line as a dict (numbers converted), or {} if there is none."""
    lines = [ln for ln in text.splitlines() if ln.startswith("final: ")]
    if not lines:
        return {}
    out = {}
    for pair in lines[-1][len("final: "):].split():
        key, _, value = pair.partition("=")
        for conv in (int, float):
            try:
                value = conv(value)
                break
            except ValueError:
                pass
        out[key] = value
    return out


def run(cmd, *, timeout: float = 180, env: dict | None = None, cwd=REPO, expect_rc: int | None = 0,
        stdin_text: str | None = None) -> Result:
    """Run `cmd`; fail the test on timeout, on an unexpected exit code, or on leftover processes."""
    cmd = [str(c) for c in cmd]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1", **(env or {})}
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, text=True, start_new_session=True,
                            stdin=subprocess.PIPE if stdin_text is not None else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    timed_out = False
    try:
        out, err = proc.communicate(stdin_text, timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)  # the session we created, and only that
        out, err = proc.communicate()
    result = Result(cmd, proc.returncode, out, err, time.time() - start, parse_final(out))

    deadline = time.time() + 10
    while session_processes(proc.pid) and time.time() < deadline:
        time.sleep(0.2)
    leftovers = session_processes(proc.pid)
    if leftovers:
        os.killpg(proc.pid, signal.SIGKILL)
    assert not timed_out, f"timed out after {timeout} s\n{result.tail()}"
    assert not leftovers, f"processes left behind: {leftovers}\n{result.tail()}"
    if expect_rc is not None:
        assert proc.returncode == expect_rc, f"expected exit {expect_rc}\n{result.tail()}"
    return result


def python(script, *args, **kw) -> Result:
    return run([PYTHON, REPO / script, *args], **kw)


def make(*args, **kw) -> Result:
    return run(["make", "--no-print-directory", *args], **kw)
