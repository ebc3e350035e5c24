"""Repeated runs of a case that can fail at random, each run once with COURSE_WORKAROUNDS=on and once with it off.

    python bench/stress.py elastic --runs 10   # make elastic-stress: torchrun restarts a crashed Gloo group
                                               #   (make elastic-restart); off: without
                                               #   TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 the restart can fail or hang
    python bench/stress.py exit --runs 10      # make exit-stress: a finished 3-rank Gloo job (distributed_eval.py)
                                               #   exits with code 0; the switch changes nothing here now (the
                                               #   os._exit guard it turned off is gone): both sides count clean exits
    python bench/stress.py free --runs 20      # make free-stress: a DDP model alive at destroy_process_group
                                               #   (exit_toy.py); on: freed first with gc.collect(), off: left to exit

The two sides alternate run by run, so that a noisy moment of the machine hits both alike. The record,
stress_<case>_<machine>_<date>.{json,md}, says how many runs passed each way, and how each failed one ended.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import time
from pathlib import Path

import benchlib
import common
from tools import course

REPO = Path(__file__).resolve().parents[1]


def elastic_run(workarounds_on: bool, nproc: int, tmp: Path, timeout: float, device: str) -> tuple[bool, str, str]:
    """make elastic-restart on short epochs: rank 1 failed, the group resumed and ended with identical weights; or
    how it failed."""
    cmd = ["make", "--no-print-directory", "-C", str(REPO), "elastic-restart", f"NPROC={nproc}",
           f"ELASTIC={tmp}/elastic", "FAIL_AT=20", "ARGS=--dataset mnist-standin --max-steps 15 --epochs 2 "
           f"--timeout 30 --data-dir {tmp}/data --device {device}"]
    return outcome(cmd, workarounds_on, timeout, ok=lambda out: recovered(out) and "resumed from" in out
                   and re.search(r"simulated failure of rank \d+ at training batch 20", out) is not None)


def recovered(out: str) -> bool:
    """compare_checkpoints said the weights match: "bitwise identical: True" after a CPU run, or
    "identical within 1e-05 (trained on a GPU): True" after a GPU run."""
    return re.search(r"(?:bitwise identical|identical within \S+ \(trained on a GPU\)): True,", out) is not None


def exit_run(workarounds_on: bool, nproc: int, tmp: Path, timeout: float, device: str) -> tuple[bool, str, str]:
    """A 3-rank Gloo job that finishes its work: exit code 0, or how it ended."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr", "127.0.0.1",
           "--nproc-per-node", "3", str(REPO / "05_collectives/distributed_eval.py"), "--subset", "10",
           "--data-dir", str(tmp / "data")]
    return outcome(cmd, workarounds_on, timeout, ok=lambda out: "exact_equals_single=True" in out)


def outcome(cmd: list[str], workarounds_on: bool, timeout: float, ok) -> tuple[bool, str, str]:
    """(passed, how it ended, its output)."""
    env = {"COURSE_WORKAROUNDS": "on" if workarounds_on else "off", "TQDM_DISABLE": "1"}
    try:
        out = benchlib.run_bounded(cmd, timeout=timeout, env=env).stdout
    except RuntimeError as err:
        text = str(err)
        if "took longer than" in text:
            return False, "hung (stopped by the timeout)", text
        found = re.search(r"(connectFullMesh failed[^\n]*|terminate called[^\n]*|SIGABRT|exitcode\s*:\s*-?\d+[^\n]*)",
                          text)
        return False, found.group(1).strip() if found else "failed", text
    return (True, "ok", out) if ok(out) else (False, "finished without the expected result", out)


def free_run(workarounds_on: bool, nproc: int, tmp: Path, timeout: float, device: str) -> tuple[bool, str, str]:
    """A finished 2-rank DDP job whose model is still alive at destroy_process_group, freed first with gc.collect()
    or not: exit code 0, or how it ended."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr", "127.0.0.1",
           "--nproc-per-node", "2", str(REPO / "bench/exit_toy.py")]
    return outcome(cmd, workarounds_on, timeout, ok=lambda out: "rank 0 done" in out)


CASES = {"elastic": (elastic_run, "the restarted group recovers (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)", 180),
         "exit": (exit_run, "the finished job exits with code 0 (no workaround left: both sides run alike)", 120),
         "free": (free_run, "the finished job exits with code 0 (gc.collect() before destroy_process_group)", 60)}


def main(argv=None) -> int:
    parser = benchlib.make_parser(__doc__, "2 runs each way")
    parser.add_argument("case", choices=sorted(CASES))
    parser.add_argument("--runs", type=benchlib.positive_int, default=10, help="runs each way (default %(default)s)")
    parser.add_argument("--nproc", type=benchlib.positive_int, default=2, help="processes (elastic only)")
    parser.add_argument("--sides", choices=("both", "on"), default="both",
                        help="both: every run with and without the workaround; on: only with it (a quick check)")
    parser.add_argument("--show", action="store_true", help="print each run's output")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="the elastic runs' device (the exit case runs on the CPU)")
    args = parser.parse_args(argv)
    if args.quick:
        args.runs = 2
    run, meaning, timeout = CASES[args.case]
    rows = []
    with tempfile.TemporaryDirectory(prefix=f"stress-{args.case}-") as tmp:
        common.prepare_data("mnist-standin", Path(tmp) / "data")
        for i in range(args.runs):
            sides = (True,) if args.sides == "on" else (True, False) if i % 2 == 0 else (False, True)  # alternate
            for on in sides:
                start = time.time()
                passed, how, out = run(on, args.nproc, Path(tmp), timeout, args.device)
                if args.show:
                    course.say(out)
                rows.append({"run": i + 1, "workaround": on, "passed": passed, "how": how,
                             "seconds": round(time.time() - start, 1)})
                course.say(f"run {i + 1}/{args.runs}, workaround {'on ' if on else 'off'}: "
                           f"{'passed' if passed else 'FAILED: ' + how}")
    with_ = sum(r["passed"] for r in rows if r["workaround"])
    without = sum(r["passed"] for r in rows if not r["workaround"])
    import torch

    # what the runs trained on: the exit case is always the CPU (distributed_eval.py); the elastic case takes
    # a GPU per process when there are enough, as common.device_and_backend does
    procs = args.nproc if args.case == "elastic" else 3
    gpu = args.case == "elastic" and args.device != "cpu" and 0 < procs <= common.usable_gpus()
    device, backend = (torch.device("cuda"), "nccl") if gpu else (torch.device("cpu"), "gloo")
    machine = benchlib.machine_info(device, backend)
    name = benchlib.stem(f"stress_{args.case}", device, backend, args.quick)
    md = [f"# Stress: {args.case}", "", f"{machine['cpu']}, {machine['cores']} cores, torch {torch.__version__}, "
          f"{machine['date']}. Passing means: {meaning}.", ""]
    md += benchlib.md_table(["workaround", "runs passed"], [["on", f"{with_}/{args.runs}"]] + (
        [["off", f"{without}/{args.runs}"]] if args.sides == "both" else []))
    md += ["", "How each run that failed ended:", ""]
    md += [f"- run {r['run']}, workaround {'on' if r['workaround'] else 'off'}: {r['how']}"
           for r in rows if not r["passed"]] or ["- none failed"]
    payload = {"bench": f"stress_{args.case}", "machine": machine, "quick": args.quick, "runs": args.runs,
               "passed_with_workaround": with_, "passed_without_workaround": without if args.sides == "both" else None,
               "meaning": meaning,
               "per_run": rows}
    paths = benchlib.write_results(Path(args.output_dir), name, payload, md)
    course.say("\n".join(md))
    course.say("written: " + ", ".join(map(str, paths)))
    return 0 if with_ == args.runs else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
