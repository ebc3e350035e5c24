"""A check-up of your own DDP training script: did you break the distributed part?

    python tools/doctor.py path/to/train.py --epochs 2            # 2 processes under torchrun, CPU + Gloo
    python tools/doctor.py --nproc 4 path/to/train.py             # more processes (NCCL if the script picks it)
    python tools/doctor.py --spawn path/to/train.py               # a script that calls mp.spawn itself
    make doctor SCRIPT=path/to/train.py ARGS="--epochs 2"

It runs your script unchanged, for a short bounded run (each epoch's training loader ends after --batches
batches, from outside), with the course's tracer watching every process (tools/tracer.py), then prints one
verdict per check and the course section that teaches the fix. Exit code 1 when a check finds the training
wrong, 0 when it finds nothing wrong (advice and information do not count), 2 when the script cannot run or
hangs (stopped after --timeout seconds, naming the ranks that were still running). The script runs in its own
folder, and nothing is written there except what your script writes itself: the trace goes to a temporary folder.

Run it for at least 2 epochs: with one, whether the order changes between epochs cannot be seen.
"""

from __future__ import annotations

import argparse
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


def extra_checks(ranks: dict, code: int | None, output: str) -> list[tracecheck.Check]:
    """Advice and information beyond the trace checks: a clean finish, the effective batch."""
    checks = []
    missing = sorted(r for r, ev in ranks.items() if not any(e["ev"] == "destroy" for e in ev))
    if code == 0 and not missing:
        checks.append(tracecheck.Check("finish", "ok", "every rank left the group with destroy_process_group()"))
    elif missing:
        checks.append(tracecheck.Check("finish", "advice", f"rank(s) {missing} never called destroy_process_group(): "
                                                           f"call it in a `finally` (section 02)"))
    elif "SIGABRT" in output:
        checks.append(tracecheck.Check("finish", "advice", "a rank aborted (SIGABRT) after destroy_process_group(): "
                                                           "a DDP model was still alive when the group went. Build "
                                                           "it in a function that returns first (section 02)"))
    else:
        checks.append(tracecheck.Check("finish", "advice", f"the run ended with exit code {code} (output below)"))
    inits = [e for ev in ranks.values() for e in ev if e["ev"] == "init"]
    if inits and inits[0].get("timeout") is None:
        checks.append(tracecheck.Check("timeout", "advice", "init_process_group() got no timeout=: a rank that "
                                                            "skips a collective makes the others wait the backend's "
                                                            "default (30 min Gloo, 10 min NCCL); pass a short one "
                                                            "(section 02)"))
    if inits:
        world = inits[0]["world_size"]
        sizes = {e.get("batch_size") for ev in ranks.values() for e in ev if e["ev"] == "loader" and e["train"]}
        sizes.discard(None)
        if len(sizes) == 1:
            size = sizes.pop()
            checks.append(tracecheck.Check("batch", "info", f"{size} samples per step per rank x {world} ranks = "
                                                            f"{size * world} per optimizer step: scale the learning "
                                                            f"rate with it, or keep the global batch (section 02)"))
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
        ranks = tracecheck.load(trace)
        if not ranks:
            tail = "\n".join(output.strip().splitlines()[-15:])
            print(f"{tail}\ndoctor: error: the script ended with exit code {code} before any process joined a "
                  f"process group (its output is above)", file=sys.stderr)
            return 2
        checks = tracecheck.judge(trace) + extra_checks(ranks, code, output)
        print(f"check-up of {opts.script.name}: {len(ranks)} ranks, exit code {code}")
        for check in checks:
            print(f"  {check}")
        wrong = [c.name for c in checks if c.verdict == "wrong"]
        print(f"verdict: {'WRONG: ' + ', '.join(wrong) if wrong else 'nothing wrong found'} (each classic error, made "
              f"on purpose and fixed: make errors)")
        if code != 0:
            print("\n".join(output.strip().splitlines()[-15:]), file=sys.stderr)
        return 1 if wrong else 0
    finally:
        shutil.rmtree(trace, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
