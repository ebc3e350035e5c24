"""The course on this machine's GPUs, in parts that each end within 9 minutes: the GPU tests, every make target
on CUDA, and the figures a reader wants.

    make gpu-check                          # the parts for this machine, their steps and time limits (PART=list)
    make gpu-check PART=tests-1             # one part (a borrowed GPU machine gives one command 10 minutes)
    make gpu-check PART=all                 # every part, one after the other (about 20 minutes on one GPU)
    make gpu-check PART=targets-2 RECORD=1  # record into bench/results instead of runs/gpu_check
    make gpu-check PART=all PY=python3      # an interpreter that holds torch instead of .venv: every step uses it
    python bench/gpu_check.py --list --gpus 8          # the plan for a machine with 8 GPUs
    python bench/gpu_check.py --part bench-1 --only bench-amp

What runs depends on the GPUs visible:
- the pytest tests marked `cuda` (one GPU) and `multigpu` (two or more), in two parts split by test file;
- every make target once, on CUDA, with short runs (one epoch or a few dozen steps): with NCCL where there is a
  GPU for every process (NPROC = the GPU count), with processes sharing the GPU through Gloo where there is only
  one (NPROC=2 --device cuda --backend gloo); demos that need more GPUs than there are say so in their row
  ("needs 2 GPUs") and run on the CPU;
- the benchmarks that give the figures, in 3 rounds: MNIST on one GPU (epoch time, accuracy; the MNIST goals
  are judged only on real MNIST, which `--dataset auto` takes when it is in data/ or can be downloaded),
  ResNet-18 images/s in fp32 (TF32 off), TF32, bf16 and fp16, DDP's cost at world size 1, DataParallel on one
  GPU, and all_reduce bus bandwidth where there are 2 GPUs or more.

Every step has a time limit; the limits of one part add up to at most PART_LIMIT_S, so that a part ends, with
its start and its report, within 9 minutes. A step that runs past its limit is stopped with every process it
started: each carries a tag in its environment (torchrun puts its workers in sessions of their own, so stopping
the step's process group is not enough).

Each part writes runs/gpu_check/gpu_check_<part>_<gpu>_<date>.{json,md} (with RECORD=1 / --record:
bench/results/), again after every step, so a part cut off from outside keeps what it finished: per step passed
or not, seconds, its `final:` line, a note; the machine (GPU, driver, torch and its CUDA, the interpreter); the
figures and goals its steps measured. The output of a failed step goes to <name>_logs/. Exit code 1 if a step
failed. The benchmarks of a part write their own results into the same folder.

A rehearsal runs the whole plan here, on the CPU, for a pretended GPU count: every make step as `make -n` (the
target exists and takes the step's variables), each pytest step as --collect-only (its selection is not empty),
and the steps named in --real for real on the CPU (`--device cuda` dropped, --real-args added to ARGS):

    python bench/gpu_check.py --rehearse --gpus 8 --part all --output-dir /tmp/rehearsal
    python bench/gpu_check.py --rehearse --gpus 1 --part targets-2 --real ddp-torchrun \\
        --real-args "--max-steps 3 --dataset mnist-standin"
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

import benchlib
import common
from tools import course

REPO = Path(__file__).resolve().parents[1]
GOALS = {"mnist_test_acc": 0.98, "mnist_epoch_s": 2.0, "resnet18_bf16_vs_fp32": 2.0}
# A borrowed GPU machine runs one command for at most 10 minutes. The step limits of a part add up to at most
# this, which leaves a minute for gpu-check's own start, the stopping of a step that ran out, and the report.
PART_LIMIT_S = 510
GROUPS = ("tests", "targets", "bench")
TAG = "COURSE_GPU_CHECK_TAG"  # in the environment of every process a step starts (the tests' harness has its own)
GRACE_S = 3.0  # SIGTERM first (torchrun then stops its workers), SIGKILL what is left after this
# the test files of the GPU tests, in two parts: the long GPU runs (resume, restart, mixed precision) apart
TEST_FILES = (("tests/test_02_ddp_spawn.py", "tests/test_03_ddp_torchrun.py", "tests/test_06_amp_syncbn.py"),
              ("tests/test_01_dataparallel.py", "tests/test_04_multinode.py", "tests/test_05_collectives.py"))


@dataclass
class Step:
    name: str
    cmd: list[str]
    timeout: float = 120  # seconds: past it, the step and everything it started are stopped
    typical: float = 30  # seconds it is expected to take (the parts' "about" in --list)
    group: str = "targets"
    note: str = ""
    skip: str = ""  # why it does not run here ("" = it runs)
    expect: str = ""  # a regular expression its output must hold to pass (besides exit code 0)
    env: dict = field(default_factory=dict)


def make(target: str, **variables) -> list[str]:
    return ["make", "--no-print-directory", target] + [f"{k}={v}" for k, v in variables.items() if v is not None]


def can_make_netns() -> bool:
    """Root alone is not enough: a container without CAP_SYS_ADMIN (a typical rented GPU) refuses `ip netns add`."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        return False
    name = f"ddp-probe-{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode != 0:
        return False
    subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    return True


def plan(gpus: int, is_root: bool = True, bench_out: str = "runs/gpu_check") -> list[Step]:
    """Every step for a machine with `gpus` GPUs, in order. Pure: tests call it with any GPU count.

    The time limits are a few times what a step is expected to take on one GPU or eight (start-up dominates:
    importing torch, CUDA and NCCL set-up; the runs themselves are short), and leave room for a first step
    that generates a stand-in data set or waits for a download that fails.
    """
    if gpus < 1:
        return []
    many = gpus >= 2
    # several processes: one GPU each with NCCL, or two sharing the one GPU through Gloo
    nproc = gpus if many else 2
    share = None if many else "--device cuda --backend gloo"
    shared_note = "" if many else "2 processes share the GPU through Gloo (NCCL needs 2 GPUs)"
    cpu_note = "" if many else "runs on the CPU with Gloo: its NCCL path needs 2 GPUs"
    short = "--max-steps 30"
    nodes_proc = max(1, gpus // 2)
    final = r"(?m)^final: .*world_size="
    # one GPU: the multigpu tests are skipped and the rest fit one part; more: the tests in two parts
    test_parts = [(TEST_FILES[0] + TEST_FILES[1], 500, 270)] if not many else [(TEST_FILES[0], 480, 240),
                                                                               (TEST_FILES[1], 300, 150)]
    steps = [Step(f"pytest-{i}", [sys.executable, "-m", "pytest", "-m", "cuda or multigpu", *files, "-q",
                                  "-p", "no:cacheprovider"], group="tests", timeout=limit, typical=typical,
                  note="" if many else "multigpu tests are skipped: they need 2 GPUs", expect=r"\d+ passed")
             for i, (files, limit, typical) in enumerate(test_parts, 1)]
    steps += [
        Step("smoke", make("smoke", DATASET="auto", ARGS="--epochs 2"), timeout=120, typical=30, expect=final,
             note="MNIST on one GPU: the figures below (the goals need real MNIST, not the stand-in)"),
        Step("dataparallel", make("dataparallel", EPOCHS=1, ARGS="--max-steps 100"), timeout=90, typical=25,
             expect=final,
             note=f"nn.DataParallel over {gpus} GPU(s)" + ("" if many else ": one GPU, nothing to split")),
        Step("dp-shapes", make("dp-shapes"), timeout=60, typical=10,
             note="" if many else "one GPU: the split for 2 is shown, not run"),
        # model parallelism wants 2 GPUs per process: with fewer than 4 its halves run on the CPU, which
        # --device cuda (the processes sharing one GPU) would refuse, so on 1 GPU it is a step of its own
        Step("ddp-basics", make("ddp-basics", NPROC=gpus // 2 if gpus >= 4 else nproc, ARGS=share,
                                DEMOS=None if many else "basic checkpoint process"), timeout=150, typical=50,
             note="; ".join(n for n in (shared_note, "" if gpus >= 4 else
                                        "model parallel needs 4 GPUs: its halves run on the CPU") if n)),
        *([] if many else [Step("ddp-basics model-parallel", make("ddp-basics", NPROC=2, DEMOS="model-parallel"),
                                timeout=90, typical=20,
                                note="model parallel needs 4 GPUs: its halves run on the CPU")]),
        Step("ddp-equivalence", make("ddp-equivalence", NPROC=2), timeout=60, typical=15,
             note="CPU by design (arithmetic)"),
        Step("ddp-spawn", make("ddp-spawn", NPROC=nproc, EPOCHS=1, ARGS=" ".join(filter(None, ("--max-steps 100",
                                                                                         share)))),
             timeout=120, typical=30, expect=rf"(?m)^final: .*world_size={nproc}\b", note=shared_note),
        Step("ddp-timeline", make("ddp-timeline", NPROC=nproc, ARGS=f"--output-dir {bench_out}/timeline_gpu "
                                  f"{share or ''}".strip()), timeout=120, typical=45, note=shared_note),
        Step("ddp-torchrun", make("ddp-torchrun", NPROC=nproc, EPOCHS=1, ARGS=share), timeout=120, typical=30,
             expect=rf"(?m)^final: .*world_size={nproc}\b", note=shared_note),
        Step("ddp-torchrun NPROC=1", make("ddp-torchrun", NPROC=1, EPOCHS=1), timeout=90, typical=25,
             expect=r"(?m)^final: .*world_size=1\b", note="NCCL at world size 1"),
        Step("init-check", make("init-check", NPROC=nproc, ARGS=share), timeout=60, typical=15,
             expect=rf"process group of {nproc} is OK", note=shared_note),
        Step("ddp-minimal", make("ddp-minimal", NPROC=gpus if many else 1), timeout=60, typical=15),
        Step("elastic-restart", make("elastic-restart", NPROC=nproc, FAIL_AT=40,
                                     ARGS=f"--epochs 2 {short} {share or ''}".strip()), timeout=150, typical=60,
             expect=r"(bitwise identical|identical within \S+ \(trained on a GPU\)): True", note=shared_note),
        # 1 run each way (stress.py gives one run 180 s): one restart that hangs still ends inside the limit
        Step("elastic-stress", make("elastic-stress", NPROC=nproc, RUNS=1, BENCH_OUT=bench_out), timeout=300,
             typical=130, note="1 run with and 1 without the workaround"),
        Step("exit-stress", make("exit-stress", RUNS=2, BENCH_OUT=bench_out), timeout=150, typical=50,
             note="Gloo on the CPU by design: the abort is in Gloo's teardown"),
        Step("free-stress", make("free-stress", RUNS=2, BENCH_OUT=bench_out), timeout=120, typical=30,
             note="Gloo on the CPU by design: a DDP model alive at destroy_process_group"),
        Step("launch-legacy", make("launch-legacy", NPROC=nproc, EPOCHS=1, ARGS=f"{short} {share or ''}".strip()),
             timeout=90, typical=25, expect=final, note=shared_note),
    ]
    for target in ("multinode-tcp", "multinode-file", "multinode-torchrun"):
        steps.append(Step(target, make(target, NNODES=2, NPROC=nodes_proc, EPOCHS=1, ARGS=short), timeout=90,
                          typical=35, expect=final,
                          note="" if many else "2 nodes need 2 GPUs: the launcher runs them on the CPU"))
    steps.append(Step("multinode-spawn", make("multinode-spawn", PROCS="2,1" if gpus >= 3 else "1,1"), timeout=90,
                      typical=30, note="" if gpus >= 2 else "2 machines need 2 GPUs: they run on the CPU"))
    steps.append(Step("multinode-netns", make("multinode-netns", NPROC=nodes_proc, EPOCHS=1, ARGS=short),
                      timeout=150, typical=45, expect=final,
                      skip="" if is_root else "needs root allowed to create network namespaces",
                      note="" if many else "2 hosts need 2 GPUs: they run on the CPU"))
    for target, limit in (("collectives", 60), ("p2p", 60), ("ddp-from-scratch", 90), ("hang-demo", 120)):
        steps.append(Step(target, make(target, NPROC=nproc), timeout=limit, typical=limit / 3, note=cpu_note))
    steps.append(Step("errors", make("errors"), timeout=240, typical=90,
                      note="Gloo on the CPU by design (the messages are Gloo's)"))
    steps += [
        Step("backend-matrix", make("backend-matrix", ARGS=f"--output-dir {bench_out}"), timeout=120, typical=40,
             note=cpu_note),
        Step("ddp-eval", make("ddp-eval", NPROC=3), timeout=60, typical=15,
             note="Gloo on the CPU by design (counting)"),
        Step("amp-syncbn", make("amp-syncbn", NPROC=nproc, EPOCHS=1, ARGS=" ".join(filter(None, ("--max-steps 100",
                                                                                           share)))),
             timeout=120, typical=30, expect=final, note=shared_note),
        Step("syncbn-proof", make("syncbn-proof", NPROC=2), timeout=60, typical=15, note="CPU by design (arithmetic)"),
        Step("grad-accum", make("grad-accum", NPROC=2), timeout=60, typical=15, note="CPU by design (arithmetic)"),
        Step("cifar-resnet", make("cifar-resnet", NPROC=nproc, ARGS=share), timeout=180, typical=50, expect=final,
             note=shared_note),
        # FSDP2 on CUDA shards over NCCL with bf16 compute; processes sharing one GPU would need Gloo's CUDA
        # all-gather and reduce-scatter, so one GPU runs one process
        Step("fsdp", make("fsdp", NPROC=gpus, EPOCHS=1, ARGS=short), timeout=120, typical=25,
             expect=rf"(?m)^final: .*world_size={gpus}\b", note="" if many else "one GPU: one process (NCCL, bf16)"),
        Step("zero", make("zero", NPROC=nproc, EPOCHS=1, ARGS=" ".join(filter(None, (short, share)))), timeout=120,
             typical=20, expect=final, note=shared_note),
        # the first step compiles (Triton kernels on a GPU): a minute at most for the ConvNet
        Step("compile", make("compile", NPROC=nproc, EPOCHS=1, ARGS=" ".join(filter(None, (short, share)))),
             timeout=300, typical=60, expect=final, note=shared_note),
        Step("uneven", make("uneven", NPROC=2), timeout=90, typical=20,
             note="Gloo on the CPU by design (the timeout is Gloo's)"),
    ]
    rounds = "--rounds 3"  # 3 rounds, not 5: the figures' spread still shows, and the part fits its time
    bench = [
        Step("bench-amp", make("bench-amp", BENCH_OUT=bench_out, ARGS=rounds), timeout=240, typical=80),
        # one world size (all the GPUs), not every one of 2, 4, 8: each is two launches per round
        Step("bench-throughput", make("bench-throughput", BENCH_OUT=bench_out, NPROC=gpus if many else None,
                                      ARGS=rounds), timeout=270, typical=120 if many else 60,
             note="" if many else "one GPU: the DDP variants with 2 processes need 2 GPUs"),
        Step("bench-allreduce", make("bench-allreduce", NPROC=gpus, BENCH_OUT=bench_out, ARGS=rounds), timeout=240,
             typical=70),
        Step("bench-buckets", make("bench-buckets", NPROC=gpus, BENCH_OUT=bench_out, ARGS=rounds), timeout=240,
             typical=70),
        Step("bench-hooks", make("bench-hooks", NPROC=gpus, BENCH_OUT=bench_out), timeout=240, typical=90),
        Step("bench-memory", make("bench-memory", BENCH_OUT=bench_out), timeout=180, typical=30,
             note="the CPU by design: bytes are counted, not timed"),
    ]
    for step in bench:
        step.group = "bench"
        if not many and step.name in ("bench-allreduce", "bench-buckets", "bench-hooks"):
            step.skip = "not run: needs 2 GPUs"
    return steps + bench


def parts(steps: list[Step]) -> dict[str, list[Step]]:
    """The steps in parts: each group (tests, targets, bench) packed first-fit, every step into the first part
    whose time limits stay within PART_LIMIT_S with it, so the steps of a part keep the plan's order. A group
    that fits in one part is named by itself (`bench`), else its parts are numbered (`targets-1`, ...). A step
    that is skipped costs nothing."""
    out = {}
    for group in GROUPS:
        chunks: list[list[Step]] = []
        for step in (s for s in steps if s.group == group):
            cost = 0.0 if step.skip else step.timeout
            home = next((c for c in chunks if budget(c)[0] + cost <= PART_LIMIT_S), None)
            if home is None:
                chunks.append(home := [])
            home.append(step)
        for i, chunk in enumerate(chunks, 1):
            out[group if len(chunks) == 1 else f"{group}-{i}"] = chunk
    return out


def budget(steps: list[Step]) -> tuple[float, float]:
    """(the sum of the time limits, the sum of the typical times) of the steps that run."""
    running = [s for s in steps if not s.skip]
    return sum(s.timeout for s in running), sum(s.typical for s in running)


def select(all_parts: dict[str, list[Step]], wanted: str) -> list[str]:
    """The part names `wanted` means: a part (targets-2), a group (targets: all its parts), or all; comma-separated."""
    names = []
    for word in (w.strip() for w in wanted.split(",") if w.strip()):
        found = list(all_parts) if word == "all" else [p for p in all_parts if p == word or p.startswith(word + "-")]
        if not found:
            raise course.UsageError(f"--part {word}: no such part here; the parts are {', '.join(all_parts)} "
                                    "(or a group: tests, targets, bench; or all)")
        names += [p for p in found if p not in names]
    return names


# ------------------------------------------------------------------ running a step, bounded

def tagged_processes(tag: str, group: int | None = None) -> list[int]:
    """PIDs of live processes whose environment holds TAG=tag, or that are in process group `group` (which
    catches a process whose environment cannot be read at that instant, in the middle of an exec)."""
    pids, marker = [], f"{TAG}={tag}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != group and marker not in (entry / "environ").read_bytes().split(b"\0"):
                continue
        except (OSError, IndexError, ValueError):
            continue
        if fields[0] not in ("Z", "X"):
            pids.append(int(entry.name))
    return pids


def stop_tagged(tag: str, group: int | None = None, grace: float = GRACE_S) -> list[int]:
    """Stop every process of a step: SIGTERM, then SIGKILL whatever is left after `grace` seconds (and what was
    started meanwhile). Returns the pids it signalled."""
    signalled = []
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        pids = tagged_processes(tag, group)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        signalled += [p for p in pids if p not in signalled]
        deadline = time.time() + wait
        while tagged_processes(tag, group) and time.time() < deadline:
            time.sleep(0.1)
    for _ in range(3):  # a process forked while the others were being killed
        left = tagged_processes(tag, group)
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.2)
    return signalled


def step_env(step: Step, tag: str, py: str | None = None) -> dict:
    """The environment of a step: this one, less make's own variables (`make gpu-check PART=x ARGS=y` would
    otherwise hand PART and ARGS to every make the step starts), plus PY when it was given, and the tag."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES", "MAKELEVEL")}
    if py:  # as make passes a command-line variable to the makes below it; the tests' harness runs make too
        env["MAKEFLAGS"] = "-- PY=" + py.replace("\\", "\\\\").replace(" ", "\\ ")
    return {**env, "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1", **step.env, TAG: tag}


def run_step(step: Step, log_dir: Path, tag: str | None = None, py: str | None = None, linger: float = 5.0) -> dict:
    """Run one step in its own session, bounded by its time limit; stop everything it started when it runs out.
    Keep its output only if it failed. Processes still running `linger` seconds after it ended fail it."""
    tag = tag or uuid.uuid4().hex
    start = time.time()
    # the output goes to a file, not a pipe: a process the step left behind would hold a pipe open, and reading
    # it to the end would wait for that process instead of for the step
    with tempfile.TemporaryFile() as output:
        proc = subprocess.Popen(step.cmd, cwd=REPO, env=step_env(step, tag, py), stdin=subprocess.DEVNULL,
                                stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        why = ""
        try:
            proc.wait(timeout=step.timeout)
        except subprocess.TimeoutExpired:
            stopped = stop_tagged(tag, proc.pid)
            why = (f"ran past its limit of {step.timeout:.0f} s: stopped with the {len(stopped)} process(es) it "
                   "had started")
            proc.wait()
        except BaseException:  # SIGTERM or Ctrl-C to gpu-check itself: leave nothing running
            stop_tagged(tag, proc.pid)
            raise
        seconds = time.time() - start
        if not why:
            deadline = time.time() + linger
            while tagged_processes(tag, proc.pid) and time.time() < deadline:
                time.sleep(0.2)
            left = stop_tagged(tag, proc.pid)
            if proc.returncode != 0:
                why = f"exit code {proc.returncode}"
            elif left:
                why = f"left {len(left)} process(es) running after it ended (stopped)"
        output.seek(0)
        out = output.read().decode(errors="replace")
    if not why and step.expect and not re.search(step.expect, out):
        why = f"its output lacks /{step.expect}/"
    log = None
    if why:
        log = log_dir / (re.sub(r"[^A-Za-z0-9_.=-]+", "_", step.name) + ".log")
        course.atomic_write_bytes(f"$ {shlex.join(step.cmd)}\n({why})\n{out}".encode(), log)
    return {"step": step.name, "passed": not why, "why": why or None, "seconds": round(seconds, 1),
            "timeout": step.timeout, "note": step.note, "command": shlex.join(step.cmd),
            "log": str(log) if log else None, "final": _final(out)}


def _final(text: str) -> dict:
    """The last `final:` line of a step's output, as a dict of strings."""
    lines = [ln for ln in text.splitlines() if ln.startswith("final: ")]
    return dict(p.split("=", 1) for p in lines[-1][len("final: "):].split() if "=" in p) if lines else {}


# ------------------------------------------------------------------ the rehearsal on the CPU

def rehearsed(step: Step, real: bool, real_args: str = "") -> Step:
    """The step as the rehearsal runs it: really, on the CPU (`--device cuda` and `--backend nccl` left out of
    ARGS, real_args added, no GPU visible), or dry: `make -n` (the target exists and takes these variables) or
    pytest --collect-only (the selection holds tests)."""
    if not real:
        if step.cmd[0] == "make":
            return replace(step, cmd=["make", "-n", *step.cmd[1:]], timeout=min(step.timeout, 30), expect="")
        return replace(step, cmd=[*step.cmd, "--collect-only"], timeout=min(step.timeout, 60),
                       expect=r"[1-9]\d*(/\d+)? tests? collected")
    if step.cmd[0] != "make":
        raise course.UsageError(f"--real {step.name}: only make steps run for real in a rehearsal")
    cmd, has_args = [], False
    for word in step.cmd:
        if word.startswith("ARGS="):
            has_args = True
            word = re.sub(r"--device cuda|--backend nccl", "", word)
            word = " ".join((word + " " + real_args).split())
        cmd.append(word)
    if not has_args and real_args:
        cmd.append(f"ARGS={real_args}")
    return replace(step, cmd=cmd, env={**step.env, "CUDA_VISIBLE_DEVICES": ""})


# ------------------------------------------------------------------ figures, goals, report

def newest(out_dir: Path, prefix: str, since: float) -> dict | None:
    """The newest results JSON named prefix_* written after `since`."""
    found = [p for p in out_dir.glob(f"{prefix}_*.json") if p.stat().st_mtime >= since and "_quick_" not in p.name]
    return json.loads(max(found, key=lambda p: p.stat().st_mtime).read_text()) if found else None


def figures(rows: list[dict], out_dir: Path, since: float, gpus: int) -> dict:
    """The GPU figures a reader wants, from the steps' final lines and the benchmarks' results."""
    fig = {}
    single = next((r for r in rows if r["step"] == "smoke" and r["passed"]), None)
    if single and single["final"]:
        f = single["final"]
        fig["mnist_one_gpu"] = {"dataset": f["dataset"], "epochs": int(f["epochs"]),
                                "test_acc": float(f["test_acc"]),
                                "seconds_per_epoch": float(f["seconds"]) / int(f["epochs"])}
    amp = newest(out_dir, "amp", since)
    if amp:
        fig["resnet18_images_per_s"] = {p: amp["results"][f"resnet18/{p}"]["median"]
                                        for p in ("fp32", "tf32", "bf16", "fp16") if f"resnet18/{p}" in amp["results"]}
        fig["resnet18_vs_fp32"] = {k.split("/")[1].replace("_vs_fp32", ""): v["median"]
                                   for k, v in amp["ratios"].items() if k.startswith("resnet18/")}
    throughput = newest(out_dir, "throughput", since)
    if throughput:
        fig["ddp_ws1_overhead"] = throughput["ratios"]["ddp_ws1_overhead"]["median"]
        fig["dataparallel_vs_plain"] = throughput["ratios"]["dataparallel_vs_plain"]["median"]
    sweep = newest(out_dir, "allreduce_sweep", since)
    if sweep:
        fig["all_reduce_busbw_GBps"] = max(r["busbw_GBps"] for r in sweep["rows"] if r["op"] == "all_reduce")
    elif gpus < 2 and any(r["step"] == "bench-allreduce" for r in rows):
        fig["all_reduce_busbw_GBps"] = "not run: needs 2 GPUs"
    return fig


def goals(fig: dict) -> dict:
    """The course's GPU goals, met or not (None: not measured). The MNIST goals are about real MNIST: a run on
    the stand-in (no MNIST in data/ and no internet) leaves them unmeasured."""
    mnist = fig.get("mnist_one_gpu")
    mnist = mnist if mnist and mnist["dataset"] == "mnist" else None
    ratio = fig.get("resnet18_vs_fp32", {}).get("bf16")
    return {"mnist_test_acc >= 0.98": None if not mnist else mnist["test_acc"] >= GOALS["mnist_test_acc"],
            "mnist_epoch_s < 2": None if not mnist else mnist["seconds_per_epoch"] < GOALS["mnist_epoch_s"],
            "resnet18 bf16 >= 2x fp32": None if ratio is None else ratio >= GOALS["resnet18_bf16_vs_fp32"]}


def driver_version() -> str | None:
    """The NVIDIA driver's version (nvidia-smi, else /proc/driver/nvidia/version), or None where there is none."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.split()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        found = re.search(r"Kernel Module\s+(\S+)", Path("/proc/driver/nvidia/version").read_text())
        return found.group(1) if found else None
    except OSError:
        return None


def machine(gpus: int, rehearse: bool) -> dict:
    """What the results were measured on: the GPU and its driver, torch and the CUDA it was built with, the
    interpreter. A rehearsal says so, with the GPU count it pretended."""
    import platform

    import torch

    device = torch.device("cpu") if rehearse else torch.device("cuda", 0)
    info = benchlib.machine_info(device, "nccl" if gpus >= 2 and not rehearse else None)
    info.update({"driver": None if rehearse else driver_version(), "torch_cuda": torch.version.cuda,
                 "executable": sys.executable, "python": platform.python_version(),
                 "rehearsal": {"gpus": gpus} if rehearse else None})
    if rehearse:
        info["gpus"] = 0
    return info


def report(part: str, rows, fig, met, info, out_dir: Path, name: str) -> list[Path]:
    title = (f"# GPU check rehearsal, part {part}: {info['rehearsal']['gpus']} pretended GPU(s), on the CPU"
             if info.get("rehearsal") else f"# GPU check, part {part}: {info['gpus']} x {info['gpu']}")
    md = [title, "", f"torch {info['torch']} (CUDA {info['torch_cuda']}), driver {info['driver']}, Python "
          f"{info['python']} ({info['executable']}), {info['cores']} CPU cores, {info['date']}.", ""]
    md += benchlib.md_table(["step", "result", "seconds", "limit", "note"],
                            [[r["step"], "passed" if r["passed"] else ("not run" if r.get("skipped") else "FAILED"),
                              f"{r['seconds']:.0f}", f"{r['timeout']:.0f}",
                              r.get("why") or r["note"] or r.get("skipped") or ""] for r in rows])
    if fig:
        md += ["", "Figures:", ""]
        md += benchlib.md_table(["figure", "value"], [[k, json.dumps(v)] for k, v in fig.items()])
    if fig:  # a part that measures none of the figures has no goal to judge
        md += ["", "Goals:", ""]
        md += benchlib.md_table(["goal", "met"], [[k, {True: "yes", False: "no", None: "not measured"}[v]]
                                                   for k, v in met.items()])
    payload = {"bench": "gpu_check", "part": part, "machine": info, "steps": rows, "figures": fig, "goals": met}
    return benchlib.write_results(out_dir, name, payload, md)


def show(all_parts: dict[str, list[Step]], gpus: int, names: list[str] | None = None) -> None:
    names = names or list(all_parts)
    course.say(f"gpu-check on {gpus} GPU(s): {len(all_parts)} parts, each within {PART_LIMIT_S} s of time limits "
               f"(run one with make gpu-check PART=NAME; PART=all runs them all)")
    for part in names:
        steps = all_parts[part]
        limit, typical = budget(steps)
        course.say(f"\n{part}: {len(steps)} step(s), time limits {limit:.0f} s, about {typical:.0f} s")
        for s in steps:
            note = f"   [{s.note}]" if s.note and not s.skip else ""
            course.say(f"{s.name:<26} {s.skip or shlex.join(s.cmd)}   (limit {s.timeout:.0f} s){note}")


def output_dir(record: bool, given: str | None = None) -> Path:
    """Where results go: runs/gpu_check (git ignores it), bench/results when recording, or the folder given."""
    return Path(given).resolve() if given else REPO / ("bench/results" if record else "runs/gpu_check")


def _stop_on_sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", default="list", help="list (default), a part, a group (tests, targets, bench), "
                        "or all; comma-separated")
    parser.add_argument("--list", action="store_true", help="the same as --part list")
    parser.add_argument("--record", action="store_true", help="write into bench/results (default: runs/gpu_check)")
    parser.add_argument("--output-dir", help="write here instead")
    parser.add_argument("--only", default="", help="comma-separated step names of the chosen part(s)")
    parser.add_argument("--gpus", type=course.positive_int, help="with --list or --rehearse: pretend N GPUs")
    parser.add_argument("--py", help="the interpreter every make of a step uses (make gpu-check PY=... gives it)")
    parser.add_argument("--rehearse", action="store_true", help="run the plan for --gpus N here, on the CPU: "
                        "make -n, pytest --collect-only, and the --real steps for real")
    parser.add_argument("--real", default="", help="with --rehearse: comma-separated steps that really run")
    parser.add_argument("--real-args", default="", help="with --rehearse: added to ARGS of the --real steps")
    args = parser.parse_args(argv)
    if args.list:
        args.part = "list"
    if args.gpus and not (args.part == "list" or args.rehearse):
        parser.error("--gpus goes with --list or --rehearse: a real check uses the GPUs that are here")
    if args.rehearse and not args.gpus:
        parser.error("--rehearse needs --gpus N: the GPU count to pretend")
    if (args.real or args.real_args) and not args.rehearse:
        parser.error("--real and --real-args go with --rehearse")
    gpus = args.gpus or common.usable_gpus()
    if gpus == 0:
        parser.exit(2, "error: gpu-check needs a CUDA GPU, and torch sees none here (torch.cuda.is_available() is "
                       "False). `--list --gpus 1` shows what it would run, `--rehearse --gpus 1` rehearses it on "
                       "the CPU.\n")
    out_dir = output_dir(args.record, args.output_dir)
    os.chdir(REPO)  # every step is a command of the course, run from its root
    bench_out = out_dir.relative_to(REPO) if out_dir.is_relative_to(REPO) else out_dir
    # the parts are cut as if every step could run, so that a part's name means the same steps on any machine
    # with this many GPUs, whatever it allows (network namespaces); what it does not allow is skipped in its part
    here = {s.name: s for s in plan(gpus, is_root=can_make_netns(), bench_out=str(bench_out))}
    all_parts = {name: [here[s.name] for s in part]
                 for name, part in parts(plan(gpus, is_root=True, bench_out=str(bench_out))).items()}
    if args.part == "list":
        show(all_parts, gpus)
        return 0
    try:
        names = select(all_parts, args.part)
    except course.UsageError as err:
        parser.error(str(err))
    chosen = {p: all_parts[p] for p in names}
    for label, wanted in (("--only", args.only), ("--real", args.real)):
        unknown = set(filter(None, wanted.split(","))) - {s.name for p in chosen.values() for s in p}
        if unknown:
            parser.error(f"{label}: no step {sorted(unknown)} in part(s) {', '.join(names)}; --list shows them")
    real = set(filter(None, args.real.split(",")))
    signal.signal(signal.SIGTERM, _stop_on_sigterm)

    import torch

    info = machine(gpus, args.rehearse)
    where = (f"rehearse{gpus}gpu_{benchlib.machine_tag(torch.device('cpu'))}" if args.rehearse
             else benchlib.machine_tag(torch.device("cuda", 0)))
    failed, written = [], []
    for part, part_steps in chosen.items():
        if args.only:
            part_steps = [s for s in part_steps if s.name in args.only.split(",")]
        name = f"gpu_check_{part}_{where}_{time.strftime('%Y-%m-%d')}"
        log_dir = out_dir / f"{name}_logs"
        since, rows, running = time.time(), [], None
        course.say(f"--- part {part}: {len(part_steps)} step(s), time limits {budget(part_steps)[0]:.0f} s")
        try:
            for i, step in enumerate(part_steps, 1):
                if step.skip:
                    rows.append({"step": step.name, "passed": False, "skipped": step.skip, "why": None,
                                 "seconds": 0.0, "timeout": step.timeout, "note": step.note,
                                 "command": shlex.join(step.cmd), "log": None, "final": {}})
                    course.say(f"[{i}/{len(part_steps)}] {step.name}: {step.skip}")
                    continue
                run = rehearsed(step, step.name in real, args.real_args) if args.rehearse else step
                running = run
                row = run_step(run, log_dir, py=args.py)
                running = None
                rows.append(row)
                course.say(f"[{i}/{len(part_steps)}] {step.name}: {'passed' if row['passed'] else 'FAILED'} "
                           f"in {row['seconds']:.0f} s" + (f" ({row['why']}; log: {row['log']})" if row["why"] else ""))
                fig = figures(rows, out_dir, since, gpus)
                written = report(part, rows, fig, goals(fig), info, out_dir, name)  # again after every step
        except KeyboardInterrupt as stop:  # Ctrl-C or SIGTERM: the step that ran is stopped, and says so
            rows.append({"step": running.name if running else "(between steps)", "passed": False,
                         "why": f"gpu-check was stopped ({stop or 'Ctrl-C'}), and every process the step had started",
                         "seconds": 0.0, "timeout": running.timeout if running else 0, "note": "",
                         "command": shlex.join(running.cmd) if running else "", "log": None, "final": {}})
            fig = figures(rows, out_dir, since, gpus)
            report(part, rows, fig, goals(fig), info, out_dir, name)
            course.say(f"stopped; what part {part} finished is in {out_dir / name}.json")
            return 130
        fig = figures(rows, out_dir, since, gpus)
        written = report(part, rows, fig, goals(fig), info, out_dir, name)
        bad = [r["step"] for r in rows if not r["passed"] and not r.get("skipped")]
        failed += bad
        course.say(f"part {part}: {len(rows) - len(bad)} of {len(rows)} steps passed or were not for this machine; "
                   f"failed: {', '.join(bad) or 'none'}. Written: {', '.join(map(str, written))}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
