"""Run course commands the way a user would, in a subprocess, and check what they leave behind.

Every command gets an outer timeout, its own session, its whole output captured, and a tag in its environment
that every process it starts inherits (torchrun puts each worker in a session of its own, so the session alone
does not find them). No tagged process may outlive the command; whatever stops the test (the outer timeout,
pytest-timeout, an assertion) kills the tagged processes first, and only those.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

# Two tests share the cores. OpenMP's waiting threads spin by default (libgomp), so a process that runs on every
# core burns, while it waits on its own threads, the core the other test needs. Waiting passively changes no
# result, only the CPU time. Set before torch is imported (both conftests import this module first); every process
# a test starts, notebook kernels included, inherits it.
os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

from tools import course  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
COLLECTED: dict[str, bool] = {}  # every test this session collected, before -m/-k: node id -> needs a GPU (conftest)
KINDS: list[str] = []  # the collected tests in the order they are handed out: their kind()
WAITS: list[bool] = []  # the tests that start processes, run, and are no notebook, in order: marked waits or not
PYTHON = sys.executable
# --local-addr: as the make targets do, so that no test depends on this machine's host name resolving
TORCHRUN = [PYTHON, "-m", "torch.distributed.run", "--local-addr", "127.0.0.1"]


def starts_processes(item) -> bool:
    return bool(item.get_closest_marker("slow") or item.path.suffix == ".ipynb")


def waits(item) -> bool:
    return item.get_closest_marker("waits") is not None


def hand_out_order(items) -> None:
    """The order pytest-xdist hands the tests out in (both workers take the next one as they get free):
    - the notebooks first (whole, the largest units first);
    - the tests marked ranks(n), one after another: each holds the cores alone (cores), so the other worker waits
      for the test it runs to end before one of them starts; in one block that wait comes once, not once per such
      test. After each of them comes a share of the quick tests (those that start no process), which the other
      worker runs while the ranks' 3 or 4 processes leave a core idle (they start, join and save one by one);
    - the other tests that start processes, those marked long first (a minute alone at the very end would leave a
      core idle), with those marked waits spread evenly among them: side by side, two of them would leave both
      cores idle while their processes wait on a timeout; skipped tests after them;
    - the rest of the quick tests last, to fill the gaps at the end instead of one worker waiting for the other's
      last long run.
    Measured (pytest's own time of `make test` in the tree, 2 cores, 2026-11-26/27): 571 s in the order before the
    ranks(n) block, 550 s with it (and bench-quick as five tests), 530 s with the quick tests beside it."""
    starting = [item for item in items if starts_processes(item)]
    quick = [item for item in items if not starts_processes(item)]
    notebooks = [item for item in starting if item.path.suffix == ".ipynb"]
    tests = [item for item in starting if item.path.suffix != ".ipynb"]
    waiting = [item for item in tests if waits(item)]
    busy = [item for item in tests if not waits(item) and not item.get_closest_marker("skip")]
    skipped = [item for item in tests if not waits(item) and item.get_closest_marker("skip")]
    ranks = [item for item in busy if item.get_closest_marker("ranks")]
    others = [item for item in busy if not item.get_closest_marker("ranks")]
    long = [item for item in others if item.get_closest_marker("long")]
    busy = ranks + long + [item for item in others if not item.get_closest_marker("long")]  # their order stays
    step = len(busy) / (len(waiting) + 1)
    place = {id(item): i for i, item in enumerate(busy)} | {id(item): (j + 1) * step - 0.5
                                                            for j, item in enumerate(waiting)}
    ordered = sorted(busy + waiting, key=lambda item: place[id(item)])
    # five sixths of the quick tests beside the ranks(n) tests (each holds the cores for 10 to 25 s, time for about
    # 30 quick ones), a sixth for the end
    share = len(quick) * 5 // 6 // max(len(ranks), 1)
    beside = {id(item): quick[i * share:(i + 1) * share] for i, item in enumerate(ranks)}
    ordered = [x for item in ordered for x in [item, *beside.get(id(item), [])]]
    items[:] = notebooks + ordered + skipped + quick[len(ranks) * share:]


def kind(item) -> str:
    """For the order's test: "notebook" (a cell), "ranks" (marked ranks(n)), "starts" (another test that starts
    processes) or "quick"."""
    if item.path.suffix == ".ipynb":
        return "notebook"
    return "quick" if not starts_processes(item) else "ranks" if item.get_closest_marker("ranks") else "starts"


def handed_out(items) -> list:
    """The tests that start processes and run, in the order pytest-xdist hands them out after the notebooks."""
    return [item for item in items if starts_processes(item) and item.path.suffix != ".ipynb"
            and not item.get_closest_marker("skip")]


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


TAG = "COURSE_TEST_TAG"
# What an outer make leaves in the environment (`make test ARGS=...`, or NPROC exported in a shell): a make started
# by a test would take it (the Makefile's `?=` variables read the environment), so no command a test starts sees it
OUTER_MAKE = {name: None for name in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", *re.findall(
    r"^([A-Z_]+) *\?=", (REPO / "Makefile").read_text(), re.M))}
TEST_IMAGES = 1000  # the MNIST test set of the data_dir fixture (conftest): 1000 is not divisible by 3
# every download goes to a proxy that is not there: offline, whether this machine has internet or not
DEAD_PROXY = {"https_proxy": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9", "no_proxy": "",
              "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9", "NO_PROXY": ""}


def tagged_processes(tag: str, group: int | None = None) -> list[int]:
    """PIDs of live (non-zombie) processes whose environment holds TAG=tag, or in process group `group`.

    Read from /proc. The group catches a process whose environment cannot be read at that instant (in the
    middle of an exec); the tag catches one that left the group (setsid, as the launchers' workers do).
    """
    pids, marker = [], f"{TAG}={tag}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != group and marker not in (entry / "environ").read_bytes().split(b"\0"):
                continue
        except OSError:
            continue
        if fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def kill_tagged(tag: str, group: int | None = None) -> None:
    for pid in tagged_processes(tag, group):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_gone(tag: str, seconds: float, group: int | None = None) -> list[int]:
    """Wait up to `seconds` for the tagged processes to end; stop any left and return their pids."""
    deadline = time.time() + seconds
    while tagged_processes(tag, group) and time.time() < deadline:
        time.sleep(0.2)
    left = tagged_processes(tag, group)
    kill_tagged(tag, group)
    return left


def stress_in_process(argv: list[str], tmp_path: Path, monkeypatch, capsys) -> tuple[int, str, Path]:
    """bench/stress.py's main(argv) in this process, as its make targets call it, with the environment
    harness.make gives a command (no outer make's variables, this interpreter as PY, a tag); stress.py works in a
    temporary folder it deletes: here that folder is tmp_path/work, kept for the test. (exit code, output, folder)"""
    import contextlib

    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import stress

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setattr(stress.tempfile, "TemporaryDirectory", lambda **_: contextlib.nullcontext(str(work)))
    for name in OUTER_MAKE:
        monkeypatch.delenv(name, raising=False)
    if PYTHON != str(REPO / ".venv/bin/python"):
        monkeypatch.setenv("MAKEFLAGS", f"PY={PYTHON}")
    tag = f"stress-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv(TAG, tag)
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")
    try:
        code = stress.main([*argv, "--output-dir", str(tmp_path)])
        left = wait_gone(tag, 10)
    finally:
        kill_tagged(tag)
    out = capsys.readouterr().out
    assert not left, f"processes left behind: {left}"
    return code, out, work


def gloo_has_list_all_to_all() -> bool:
    """Whether this torch's Gloo runs the list form of all_to_all (2.14 does, 2.11 refuses it), asked of a one-rank
    Gloo group in this process: the test's own answer, not the script's."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=10))
    try:
        group.alltoall([torch.zeros(1)], [torch.ones(1)]).wait()
        return True
    except RuntimeError as refused:
        assert "does not support alltoall" in str(refused), refused
        return False


def parse_final(text: str) -> dict:
    """The last `final: key=value ...` line as a dict (numbers converted), or {} if there is none."""
    rows = course.parse_lines(text, "final")
    return rows[-1] if rows else {}


def run(cmd, *, timeout: float = 180, env: dict | None = None, cwd=REPO, expect_rc: int | None = 0,
        stdin_text: str | None = None, linger: float = 10) -> Result:
    """Run `cmd`; fail the test on timeout, on an unexpected exit code, or on leftover processes.

    Processes still running `linger` seconds after `cmd` ended count as left behind (and are stopped).
    """
    cmd = [str(c) for c in cmd]
    tag = uuid.uuid4().hex
    full_env = {**os.environ, **OUTER_MAKE, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1", **(env or {}), TAG: tag}
    full_env = {k: v for k, v in full_env.items() if v is not None}  # env={"NAME": None} removes NAME
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, text=True, start_new_session=True,
                            stdin=subprocess.PIPE if stdin_text is not None else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    timed_out = False
    try:
        out, err = proc.communicate(stdin_text, timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_tagged(tag, proc.pid)  # what we started, and only that
        out, err = proc.communicate()
    except BaseException:  # pytest-timeout, Ctrl-C: leave nothing running
        kill_tagged(tag, proc.pid)
        raise
    result = Result(cmd, proc.returncode, out, err, time.time() - start, parse_final(out))

    leftovers = wait_gone(tag, linger, proc.pid)
    assert not timed_out, f"timed out after {timeout} s\n{result.tail()}"
    assert not leftovers, f"processes left behind: {leftovers}\n{result.tail()}"
    if expect_rc is not None:
        assert proc.returncode == expect_rc, f"expected exit {expect_rc}\n{result.tail()}"
    return result


def python(script, *args, **kw) -> Result:
    return run([PYTHON, REPO / script, *args], **kw)


_IN_ONE_PROCESS = r"""
import contextlib, io, json, os, runpy, sys
results, environ = [], dict(os.environ)
for script, argv, env in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    sys.argv, sys.path[0] = [script, *argv], os.path.dirname(script)
    os.environ.clear()
    os.environ.update({**environ, **env})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, (int, type(None))) else str(stop.code)
    results.append([code, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""


def exits(calls: list[tuple], env: dict | None = None, timeout: float = 300, fresh: bool = False) -> list[tuple]:
    """(exit code, stdout, stderr) of each call (SCRIPT, ARGV) or (SCRIPT, ARGV, ENV) that ends before it trains.

    For help, bad input and checks: all calls run in one process forked from one that imported torch (forked()),
    instead of starting Python and torch once per call. `env` applies to every call, a call's ENV on top of it. The
    script's `__main__` block runs as usual (COURSE_WORKAROUNDS=off: no workaround changes how it ends). A SystemExit
    with a message gives the message as its code. fresh: a new interpreter instead, for an `env` that torch reads as
    it is imported (CXX: inductor's compiler, read into its config then).
    """
    import json

    payload = json.dumps([[str(REPO / call[0]), [str(a) for a in call[1]], call[2] if len(call) > 2 else {}]
                          for call in calls])
    env = {**(env or {}), "COURSE_WORKAROUNDS": "off"}
    if fresh:
        return [tuple(r) for r in json.loads(run([PYTHON, "-c", _IN_ONE_PROCESS, payload], env=env,
                                                 timeout=timeout).stdout)]
    with tempfile.TemporaryDirectory(prefix="course-exits-") as tmp:
        return [tuple(r) for r in json.loads(forked(_IN_ONE_PROCESS, [payload], Path(tmp), env, timeout))]


_DRIVER = r"""
import json, os, shutil, sys, time
from pathlib import Path
import torch, torch._dynamo, torchvision  # imported already in _ZYGOTE, which forks this driver: not in every rank
from tools import course, mutants, tracer
exec(sys.argv[3])  # the test's own setup (faults to inject, say), before the tracer records what the scripts call
tracer.install(sys.argv[2])
results = []
for step in json.loads(sys.argv[1]):
    if "copy" in step:
        shutil.copytree(*step["copy"])
        continue
    CRASH, start, per_rank = step.get("crash"), time.time(), step.get("rank_args")
    codes, output = mutants.run(mutants.REPO / step["script"], step.get("how", "torchrun"), step["args"],
                                Path(step["folder"]), timeout=120, nproc=step.get("nproc", 2),
                                rank_args=per_rank and (lambda r: per_rank[r]))
    folder = Path(step.get("listing") or "-")
    listing = {p.name: sorted(q.name for q in p.iterdir()) if p.is_dir() else None
               for p in sorted(folder.iterdir())} if folder.is_dir() else None
    finals = course.parse_lines(output, "final")
    results.append({"codes": codes, "output": output, "seconds": time.time() - start, "listing": listing,
                    "final": finals[-1] if finals else {}})
print(json.dumps(results))
"""


# The drivers of one pytest worker are forked from one process that imported torch once (about 3 CPU-seconds a
# start): it reads a request per line, forks a driver for it, waits for it (killing its process group after the
# request's timeout) and answers with its exit code. It ends when the worker closes its standard input.
_ZYGOTE = r"""
import gc, json, os, signal, sys, time, traceback
import torch, torch._dynamo, torchvision
from tools import course, mutants, tracer
gc.freeze()  # what is imported stays out of the collector's walks: the forks do not copy those pages by touching them
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setpgid(0, 0)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            for fd, path in ((1, req["result"]), (2, req["log"])):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
            os.chdir(req["cwd"])
            os.environ.clear()
            os.environ.update(req["env"])
            sys.argv = ["-c", *req["argv"]]
            exec(compile(req["code"], "<driver>", "exec"), {"__name__": "__main__"})
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline, code = time.time() + req["timeout"], None
    while code is None and time.time() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
        else:
            time.sleep(0.05)
    try:
        os.killpg(pid, signal.SIGKILL)  # what is left of the driver's process group; all of it after a timeout
    except ProcessLookupError:
        pass
    if code is None:
        os.waitpid(pid, 0)
    print(json.dumps({"code": code}), flush=True)
"""
_zygote: subprocess.Popen | None = None


def _fork_server() -> subprocess.Popen:
    """This worker's forking process (_ZYGOTE), started at its first drive() and ended with the worker."""
    global _zygote
    if _zygote is None or _zygote.poll() is not None:
        env = {k: v for k, v in {**os.environ, **OUTER_MAKE, "PYTHONUNBUFFERED": "1"}.items() if v is not None}
        _zygote = subprocess.Popen([PYTHON, "-c", _ZYGOTE], cwd=REPO, env=env, text=True, stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
        atexit.register(_end_fork_server, _zygote)
    return _zygote


def _end_fork_server(zygote: subprocess.Popen) -> None:
    zygote.stdin.close()  # its loop ends
    try:
        zygote.wait(timeout=10)
    except subprocess.TimeoutExpired:
        zygote.kill()
        zygote.wait()


def forked(code: str, argv: list[str], folder: Path, env: dict | None = None, timeout: float = 280) -> str:
    """What `python -c CODE ARGV...` prints, run in a process forked from this worker's _ZYGOTE (torch imported
    once), with the environment run() gives a command (plus `env`), from the repository's root; what torch read from
    the environment as it was imported stays as the worker's environment had it. Its standard output and error go
    to files in `folder`; an exit code other than 0, or the timeout, fails with the error's tail."""
    returncode, out, err = _forked(code, argv, folder, env, timeout)
    ended = returncode if returncode is not None else f"a timeout of {timeout} s"
    assert returncode == 0, f"the forked process ended with {ended}:\n{err[-4000:]}"
    return out


def in_fork(code: str, env: dict | None = None, timeout: float = 120) -> Result:
    """run([PYTHON, "-c", code]) for a check in one process, forked as forked() forks (exit code 0 expected)."""
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="course-fork-") as tmp:
        returncode, out, err = _forked(code, [], Path(tmp), env, timeout)
    result = Result(["python", "-c", code], -9 if returncode is None else returncode, out, err, time.time() - start)
    assert returncode == 0, f"expected exit 0\n{result.tail()}"
    return result


def _forked(code: str, argv: list[str], folder: Path, env: dict | None, timeout: float) -> tuple:
    """(exit code or None after the timeout, standard output, standard error) of a process forked by _ZYGOTE."""
    import json
    import select

    result, log = folder / "forked-stdout.txt", folder / "forked-stderr.txt"
    full_env = {k: v for k, v in {**os.environ, **OUTER_MAKE, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1",
                                  **(env or {})}.items() if v is not None}
    zygote = _fork_server()
    zygote.stdin.write(json.dumps({"code": code, "argv": argv, "result": str(result), "log": str(log),
                                   "cwd": str(REPO), "env": full_env, "timeout": timeout}) + "\n")
    zygote.stdin.flush()
    ready, _, _ = select.select([zygote.stdout], [], [], timeout + 30)
    answer = zygote.stdout.readline() if ready else ""
    assert answer, f"the forking process did not answer within {timeout + 30:.0f} s"
    read = [p.read_text(errors="replace") if p.exists() else "" for p in (result, log)]
    return json.loads(answer)["code"], *read


def drive(runs: list, tmp_path, setup: str = "", timeout: float = 280) -> list[dict]:
    """Several runs of the course's scripts for the price of a fork: a driver (forked(), from a process that
    imported torch once for this pytest worker) forks the ranks of each run (tools/mutants.run gives them torchrun's
    variables, or forks mp.spawn's children), watched by the course's tracer. For tests whose claim is what a script
    computes, not how a launcher starts it (the launchers have tests of their own). `runs`: a list of
    {"copy": [src, dst]} or a run: {"script" (from the repository's root), "args", "folder" (its trace and output),
    optionally "how" ("torchrun", the default, or "spawn"), "nproc" (2), "rank_args" (one list per rank, added to
    its arguments), "crash" (a name the setup code reads as CRASH) and "listing" (a folder whose entries the result
    lists)}. One result per run: its exit codes, the ranks' output, its last `final:` line as a dict, its seconds
    and the listing."""
    import json

    return json.loads(forked(_DRIVER, [json.dumps(runs), str(tmp_path / "driver-trace"), setup], tmp_path,
                             timeout=timeout))


def make(*args, **kw) -> Result:
    """make TARGET ... with this interpreter: `make test PY=...` runs the targets with that PY too (a PY among
    `args` comes later on the command line and wins)."""
    own = [] if Path(sys.prefix) == REPO / ".venv" else [f"PY={PYTHON}"]
    return run(["make", "--no-print-directory", *own, *args], **kw)


def bare_python(folder: Path) -> str:
    """An interpreter with the same torch as this one and no install of the course: a new virtual environment whose
    only .pth file puts this interpreter's site-packages on its path, as plain folders, so that their .pth files (the
    course's editable install among them) are not read. It stands for a cluster's or a GPU host's Python."""
    import site
    import sysconfig

    if not (folder / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=120)
    purelib = sysconfig.get_path("purelib", vars={"base": str(folder), "platbase": str(folder)})
    found = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])  # pip --user
    Path(purelib, "course_deps.pth").write_text("\n".join(found) + "\n")
    return str(folder / "bin" / "python")


# what a command started with an interpreter that has no course install sees: no PYTHONPATH from outside
BARE_ENV = {"PYTHONPATH": None}


def traced(trace_dir) -> dict:
    """The environment that switches the course's tracer on in every process a command starts (tools/tracer.py)."""
    path = os.pathsep.join(filter(None, [str(REPO / "tools" / "trace"), os.environ.get("PYTHONPATH")]))
    return {"COURSE_TRACE": str(trace_dir), "PYTHONPATH": path}


def check_trace(trace_dir, world_size: int, epochs: int, checks=("shards", "order", "ddp", "buffers", "eval",
                                                                  "eval_sum")) -> dict:
    """The trace of a run: `world_size` ranks, `epochs` training passes each, and every check named "ok"
    (shards disjoint and covering, a new order every epoch, DDP with equal replicas and BatchNorm buffers, every
    test sample evaluated once and the sums combined). Returns the verdicts."""
    from tools import tracecheck

    ranks = tracecheck.load(trace_dir)
    assert sorted(ranks) == list(range(world_size)), f"ranks seen: {sorted(ranks)}"
    for rank, events in ranks.items():
        passes = [e for e in events if e["ev"] == "loader" and e["train"]]
        assert len(passes) == epochs, f"rank {rank}: {len(passes)} training passes, not {epochs}"
    verdicts = {c.name: c for c in tracecheck.judge(trace_dir)}
    wrong = [str(verdicts[name]) for name in checks if verdicts[name].verdict != "ok"]
    assert not wrong, "\n".join(wrong)
    return verdicts


@contextlib.contextmanager
def cores(alone: bool):
    """With 2 pytest workers (make test), at most about 4 training processes at once on a 2-core machine: a test
    that starts processes holds a shared lock while it runs; one that starts 3 or more training processes (marked
    ranks(n)) holds it alone. Without pytest-xdist it does nothing."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    # with 8 cores or more (a GPU host) there is room for every worker's processes; and there a test that waits for
    # the machine to itself would wait for all the other workers' shared holds to end at once, which may be never
    if not run or len(os.sched_getaffinity(0)) >= 8:
        yield
        return
    with open(Path(tempfile.gettempdir()) / f"course-cores-{run}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)  # released when the file closes
        yield
