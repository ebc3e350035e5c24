"""A check-up of your own DDP training script: did you break the distributed part?

    python tools/doctor.py path/to/train.py --epochs 2            # 2 processes under torchrun, CPU + Gloo
    python tools/doctor.py --nproc 4 path/to/train.py             # more processes (NCCL if the script picks it)
    python tools/doctor.py --spawn path/to/train.py               # a script that calls mp.spawn itself
    make doctor SCRIPT=path/to/train.py ARGS="--epochs 2"

It runs your script unchanged, for a short bounded run (each epoch's training loader ends after --batches
batches, from outside), with the course's tracer watching every process (tools/tracer.py), then prints one
verdict per check and the course section that teaches the fix. Exit code 1 when a check finds the training
wrong, 0 when it finds nothing wrong (advice and information do not count), 2 when the script cannot run, fails
(its failing rank's last lines are shown; a rank that only aborts as its interpreter exits, after its work, gets
advice instead), needs CUDA where there is none (one line), or hangs (stopped after --timeout seconds, naming the
ranks that were still running). Through make, make itself exits 2 whenever the doctor does not exit 0; its last
line, `make: *** [...: doctor] Error K`, carries the doctor's code K. The script runs in its own
folder, and nothing is written there except what your script writes itself: the trace goes to a temporary folder.

Run it for at least 2 epochs: with one, whether the order changes between epochs cannot be seen.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO)]

from tools import tracecheck  # noqa: E402

TAG = "COURSE_DOCTOR_TAG"


def _tagged(tag: str) -> list[int]:
    """PIDs of live processes of this check-up (the tag is in their environment), from /proc."""
    pids, marker = [], f"{TAG}={tag}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z" and marker in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def launch(script: Path, args: list[str], nproc: int, spawn: bool, trace: Path, batches: int,
           timeout: float) -> tuple[int | None, str, list[int]]:
    """Run the script; (exit code or None after a timeout, its output's tail, the PIDs still running then)."""
    if spawn:
        cmd = [sys.executable, str(script), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr", "127.0.0.1",
               "--nproc-per-node", str(nproc), str(script), *args]
    tag = uuid.uuid4().hex
    path = os.pathsep.join(filter(None, [str(REPO / "tools" / "trace"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "COURSE_TRACE": str(trace), "PYTHONPATH": path, "COURSE_TRACE_MAX_BATCHES": str(batches),
           "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1", TAG: tag}
    env.setdefault("OMP_NUM_THREADS", "1")
    log = trace / "output.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=script.parent)  # where the script's own paths start
        try:
            code, left = proc.wait(timeout=timeout), []
        except subprocess.TimeoutExpired:
            code, left = None, _tagged(tag)
        finally:
            for sig in (signal.SIGTERM, signal.SIGKILL):  # whatever is left, and only what this check-up started
                for pid in _tagged(tag):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
                deadline = time.time() + 5
                while _tagged(tag) and time.time() < deadline:
                    time.sleep(0.1)
            proc.wait()
    return code, log.read_text(errors="replace"), left


def _rank_of(trace: Path, pids: list[int]) -> list[str]:
    """What the processes still running at the timeout were: their rank and the last thing they did."""
    found = []
    for pid in pids:
        path = trace / f"trace-{pid}.jsonl"
        if path.exists():
            lines = path.read_text().splitlines()
            last = lines[-1] if lines else "{}"
            rank = re.search(r'"rank": (\d+)', last)
            what = re.search(r'"ev": "(\w+)"(?:.*?"op": "(\w+)")?', last)
            found.append(f"rank {rank.group(1) if rank else '?'} (last seen: "
                         f"{' '.join(filter(None, what.groups())) if what else 'start-up'})")
    return sorted(set(found))


NO_CUDA = re.compile(r"(?:Found no NVIDIA driver|Torch not compiled with CUDA|No CUDA GPUs are available|"
                     r"CUDA driver initialization failed|ProcessGroupNCCL is only supported with GPUs|"
                     r"Attempting to deserialize object on a CUDA device)[^.!\n]*")


def needs_cuda(output: str, trace: Path) -> str | None:
    """The first error that says the script wants CUDA where there is none, else None: from each process's own
    exception (the tracer's records), then from the output, where two ranks' lines can interleave."""
    for text in ["".join(lines) for lines in errors(trace).values()] + [output]:
        if found := NO_CUDA.search(text):
            return found.group(0).strip()
    return None


def exit_codes(output: str) -> dict[int, int | str]:
    """Each failed rank's exit code (a negative number, or a signal's name, when a signal ended it), from
    torchrun's failure summary or mp.spawn's exception."""
    codes: dict[int, int | str] = {}
    for rank, code in re.findall(r"rank\s*: (\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*: (-?\d+)", output):
        codes[int(rank)] = int(code)
    for rank, code, signal_name in re.findall(r"process (\d+) terminated with (?:exit code (\d+)|signal (\w+))",
                                              output):
        codes[int(rank)] = int(code) if code else signal_name
    for rank in re.findall(r"-- Process (\d+) terminated with the following error", output):
        codes.setdefault(int(rank), 1)
    return codes


def errors(trace: Path) -> dict:
    """The last lines of each uncaught exception the tracer saw, by rank (None: a process that is no rank, such as
    mp.spawn's parent)."""
    found = {}
    for path in sorted(trace.glob("trace-*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            if '"ev": "error"' in line:
                event = json.loads(line)
                found[event["rank"]] = event["lines"]
    return found


SECONDARY = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|Socket Timeout|"
                       r"ProcessGroup.*(?:aborted|terminated)|DistNetworkError", re.I)


def failure(ranks: dict, code: int | None, output: str, trace: Path) -> tuple[str, int | None] | None:
    """Why the run failed and which rank failed first, or None when every rank reached the end of the script (a rank
    that only aborts in the interpreter's exit, after its work, has not failed: that is the finish check's advice).
    The rank that failed first: one whose own exception is not the loss of a peer, else torchrun's root cause."""
    if code == 0:
        return None
    codes = exit_codes(output)
    ended = all(any(e["ev"] == "exit" for e in ev) and not any(e["ev"] == "error" for e in ev)
                for ev in ranks.values())
    positive = {r: c for r, c in codes.items() if isinstance(c, int) and c > 0}
    if ended and not positive:
        return None
    own = [r for r, lines in errors(trace).items() if r is not None and not SECONDARY.search("".join(lines[-2:]))]
    root = re.search(r"Root Cause.*?rank\s*: (\d+)", output, re.S)
    rank = min(own) if own else int(root.group(1)) if root else min(positive or codes, default=None)
    if rank is None:
        return f"the script ended with exit code {code}", None
    if rank in own:
        return f"rank {rank} failed: {errors(trace)[rank][-1].strip()}", rank
    rank_code = codes.get(rank, 1)
    how = f"exit code {rank_code}" if isinstance(rank_code, int) and rank_code > 0 else \
        f"signal {str(rank_code).lstrip('-')}"
    return f"rank {rank} failed ({how})", rank


def extra_checks(ranks: dict, code: int | None, output: str, trace: Path) -> list[tracecheck.Check]:
    """Advice and information beyond the trace checks: a clean finish, the effective batch."""
    checks = []
    missing = sorted(r for r, ev in ranks.items() if not any(e["ev"] == "destroy" for e in ev))
    aborted = code != 0 and failure(ranks, code, output, trace) is None
    if code == 0 and not missing:
        checks.append(tracecheck.Check("finish", "ok", "every rank left the group with destroy_process_group()"))
    elif missing and aborted:
        checks.append(tracecheck.Check("finish", "advice", f"rank(s) {missing} never called destroy_process_group() "
                                                           f"and aborted as the interpreter exited, after their work "
                                                           f"(the launcher's exit code is {code}): call it at the end, "
                                                           f"in a `finally` (section 02)"))
    elif missing:
        checks.append(tracecheck.Check("finish", "advice", f"rank(s) {missing} never called destroy_process_group(): "
                                                           f"call it in a `finally` (section 02)"))
    elif aborted:
        checks.append(tracecheck.Check("finish", "advice", "a rank aborted (SIGABRT) after destroy_process_group(): "
                                                           "a DDP model was still alive when the group went. Call "
                                                           "gc.collect() just before destroy_process_group(): the "
                                                           "first DDP model of a process lives in a reference cycle, "
                                                           "also after the function that built it returned "
                                                           "(section 02)"))
    else:
        checks.append(tracecheck.Check("finish", "failed", f"the run ended with exit code {code} (see below)"))
    inits = [e for ev in ranks.values() for e in ev if e["ev"] == "init"]
    if inits and inits[0].get("timeout") is None:
        checks.append(tracecheck.Check("timeout", "advice", "init_process_group() got no timeout=: a rank that "
                                                            "skips a collective makes the others wait the backend's "
                                                            "default (30 min Gloo, 10 min NCCL); pass a short one "
                                                            "(section 02)"))
    if inits:
        world = inits[0]["world_size"]
        passes = [e for ev in ranks.values() for e in ev if e["ev"] == "loader" and e["train"]]
        sizes = {e.get("batch_size") for e in passes} - {None}
        steps = {e.get("first_step_at") for e in passes} - {None}  # batches fetched by the first optimizer step
        if len(sizes) == 1 and len(steps) <= 1:
            size, every = sizes.pop(), steps.pop() if steps else 1
            what = f"{size} samples per batch per rank x {every} batches per step" if every > 1 else \
                f"{size} samples per step per rank"
            checks.append(tracecheck.Check("batch", "info", f"{what} x {world} ranks = {size * every * world} per "
                                                            f"optimizer step: scale the learning rate with it, or "
                                                            f"keep the global batch (section 02)"))
    return checks


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     usage="%(prog)s [options] SCRIPT [SCRIPT'S ARGUMENTS ...]")
    parser.add_argument("--nproc", type=int, default=2, help="processes to start (default %(default)s)")
    parser.add_argument("--spawn", action="store_true", help="the script starts its processes itself (mp.spawn)")
    parser.add_argument("--batches", type=int, default=5, help="training batches per epoch (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=180, help="seconds before the run is stopped (default "
                                                                   "%(default)s)")
    parser.add_argument("script", type=Path)
    parser.add_argument("args", nargs=argparse.REMAINDER)
    opts = parser.parse_args(argv)
    if not opts.script.is_file() or opts.script.suffix != ".py":
        print(f"doctor: error: {opts.script} is not a Python script", file=sys.stderr)
        return 2
    if opts.nproc < 2 or opts.batches < 1 or opts.timeout <= 0:
        print("doctor: error: --nproc must be at least 2 (ranks are compared), --batches at least 1, --timeout "
              "positive", file=sys.stderr)
        return 2
    spawn = opts.spawn or bool(re.search(r"\bmp\.spawn\(|\bspawn\(|start_processes\(", opts.script.read_text()))
    trace = Path(tempfile.mkdtemp(prefix="course-doctor-"))
    try:
        how = "itself (mp.spawn)" if spawn else f"under torchrun with {opts.nproc} processes"
        print(f"doctor: running {' '.join([str(opts.script), *opts.args])} {how}, {opts.batches} training batches "
              f"per epoch, at most {opts.timeout:g} s", flush=True)
        code, output, left = launch(opts.script.resolve(), opts.args, opts.nproc, spawn, trace, opts.batches,
                                    opts.timeout)
        if code is None:
            waiting = _rank_of(trace, left)
            print(f"doctor: error: stopped after {opts.timeout:g} s; still running: "
                  f"{', '.join(waiting) or 'the launcher'}. A rank waits in a collective the others never call "
                  f"(section 05, 'Hangs'); nothing is left running", file=sys.stderr)
            return 2
        cuda = needs_cuda(output, trace) if code != 0 else None
        if cuda:
            print(f"doctor: error: the script needs CUDA and this machine has none ({cuda}): run it on a machine "
                  f"with a GPU, or let it choose the CPU and Gloo when torch.cuda.is_available() is False "
                  f"(section 02)", file=sys.stderr)
            return 2
        ranks = tracecheck.load(trace)
        if not ranks:
            tail = "\n".join(output.strip().splitlines()[-15:])
            print(f"{tail}\ndoctor: error: the script ended with exit code {code} before any process joined a "
                  f"process group (its output is above)", file=sys.stderr)
            return 2
        checks = tracecheck.judge(trace) + extra_checks(ranks, code, output, trace)
        print(f"check-up of {opts.script.name}: {len(ranks)} ranks, exit code {code}")
        for check in checks:
            print(f"  {check}")
        wrong = [c.name for c in checks if c.verdict == "wrong"]
        failed = failure(ranks, code, output, trace)
        if failed:
            why, rank = failed
            print(f"verdict: FAILED: {why}; the checks above cover only what ran before")
            found = errors(trace)
            lines = found.get(rank) or found.get(None) or next(iter(found.values()), None)
            last = "".join(lines).rstrip() if lines else "\n".join(output.strip().splitlines()[-15:])
            print(f"{last}\ndoctor: error: {why} (its last lines are above)", file=sys.stderr)
            return 2
        print(f"verdict: {'WRONG: ' + ', '.join(wrong) if wrong else 'nothing wrong found'} (each classic error, made "
              f"on purpose and fixed: make errors)")
        return 1 if wrong else 0
    finally:
        shutil.rmtree(trace, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
