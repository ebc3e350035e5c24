"""The course on this machine's GPUs in one command of about 9 minutes: first the figures on the idle GPU, then
the test suite and every CUDA step of the course side by side.

    make gpu-check                          # the one command (a host with 8 cores or more); results: runs/gpu_check/
    make gpu-check PY=python3               # the host's own torch instead of .venv: every step uses it
    make gpu-check RECORD=1                 # the results into bench/results/ instead
    make gpu-check OUT_DIR=/some/folder     # ... or into this folder
    make gpu-check PART=list                # a host with fewer cores: the same steps in parts of up to 9 minutes
    make gpu-check PART=targets-1           # ... one part
    python bench/gpu_check.py --list --gpus 8 --cores 16   # the plan for such a machine, from any machine

What runs, in this order:
1. The figures, one step after another on the idle GPU: MNIST on one GPU (epoch time, accuracy: judged against
   the goals only on real MNIST, which `--dataset auto` takes from data/ or downloads), ResNet-18 images/s in fp32
   (TF32 off), TF32, bf16 and fp16, DDP at world size 1 against the bare loop; with 2 GPUs or more also the DDP
   variants over all of them and the all_reduce bus bandwidth.
2. Then streams side by side, each one step after another: the suite (pytest -n W over tests/, the `cuda` and
   `multigpu` tests included; W from the cores), and every step that runs on CUDA (make targets with short runs):
   with NCCL where there is a GPU for every process (NPROC = the GPU count), with two processes sharing the GPU
   through Gloo where there is one. Steps that are CPU by design (arithmetic, counting, Gloo's own messages) are not
   repeated: the suite runs them.
The time limits of the figures and of any one stream add up to at most COMMAND_LIMIT_S (480 s): the command ends
within 9 minutes with its start and its report. A step past its limit is stopped with every process it started
(each carries a tag in its environment: torchrun puts its workers in sessions of their own); when the command
ends, nothing it started is left.

It writes one folder (runs/gpu_check/, RECORD=1: bench/results/, or OUT_DIR) of at most 3 files:
gpu_check_<gpu>_<date>.json (the machine, every step passed / failed / not for this machine with its seconds and
`final:` line, the suite's counts, the figures against their goals, the benchmarks' own results), the same as a
report .md, and gpu_check_<gpu>_<date>_logs.tar.gz with the output of every step that failed. Both are written
again after every step, so a command cut off from outside keeps what it finished. Exit code 1 if a step failed.

A rehearsal runs the plan here, on the CPU, for a pretended GPU and core count: every make step as `make -n` (the
target exists and takes the step's variables), each pytest step as --collect-only (its selection is not empty),
the steps named in --real for real on the CPU (`--device cuda` and `--backend nccl` dropped, --real-args added to
ARGS), and --limit shortens a step's limit:

    python bench/gpu_check.py --rehearse --gpus 8 --cores 16 --output-dir /tmp/rehearsal
    python bench/gpu_check.py --rehearse --gpus 1 --cores 16 --real ddp-torchrun --real-args "--max-steps 3"
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

import benchlib  # first: it puts the course's root on sys.path
import common
from tools import course

REPO = Path(__file__).resolve().parents[1]
GOALS = {"mnist_test_acc": 0.98, "mnist_epoch_s": 2.0, "resnet18_bf16_vs_fp32": 2.0}
# A borrowed GPU machine runs one command for at most 10 minutes. The figures' limits plus those of any one stream
# add up to at most this, which leaves a minute for the command's own start, the stopping of a step that ran out,
# and the report; a part (PART=) of a smaller host is held to the same.
COMMAND_LIMIT_S = 480
ONE_COMMAND_CORES = 8  # fewer cores: the streams would starve each other, so the host runs the parts one by one
GROUPS = ("figures", "tests", "targets")
TAG = "COURSE_GPU_CHECK_TAG"  # in the environment of every process a step starts (the tests' harness has its own)
GRACE_S = 3.0  # SIGTERM first (torchrun then stops its workers), SIGKILL what is left after this
# for the parts of a small host (PART=tests-N): the test files whose GPU tests are long runs (resume, restart,
# mixed precision) form the first part, the other files with GPU tests the second
LONG_GPU_TESTS = ("tests/test_02_ddp_spawn.py", "tests/test_03_ddp_torchrun.py", "tests/test_06_amp_syncbn.py")


def gpu_test_files() -> tuple[list[str], list[str]]:
    """The test files that hold tests marked cuda or multigpu, in two groups: the long ones, the others."""
    marked = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py")
                    if re.search(r"@pytest\.mark\.(cuda|multigpu)\b", p.read_text()))
    return [f for f in marked if f in LONG_GPU_TESTS], [f for f in marked if f not in LONG_GPU_TESTS]


# make targets that are CPU by design: `make test` runs them on any machine (the stress targets and bench-memory:
# repeated runs recorded on the CPU), not again as a step here
CPU_BY_DESIGN = {
    "ddp-equivalence": "arithmetic: DDP's average against one process, in float64 on the CPU",
    "errors": "the messages are Gloo's",
    "ddp-eval": "counting: which samples each rank evaluates",
    "syncbn-proof": "arithmetic: the all_reduce batch norm against BatchNorm2d",
    "grad-accum": "arithmetic: the gradients with and without no_sync",
    "uneven": "the timeout that fails is Gloo's",
    "exit-stress": "the abort it counts is in Gloo's teardown",
    "free-stress": "a DDP model alive at destroy_process_group, on Gloo",
    "bench-memory": "bytes are counted, not timed",
}


# the targets that run on CUDA only with a GPU per process: on one GPU they run on the CPU, which the suite does
NEEDS_TWO_GPUS = ("dp-shapes", "multinode-tcp", "multinode-file", "multinode-torchrun", "multinode-spawn",
                  "multinode-netns", "collectives", "p2p", "ddp-from-scratch", "hang-demo", "backend-matrix",
                  "bench-buckets", "bench-hooks", "bench-allreduce", "elastic-stress")


def left_to_the_suite(gpus: int) -> dict[str, str]:
    """The make targets gpu-check does not run as a step on this many GPUs, and why: the suite (or a record made on
    the CPU) covers them."""
    return {**CPU_BY_DESIGN, **({t: "needs 2 GPUs to run on CUDA" for t in NEEDS_TWO_GPUS} if gpus < 2 else {})}


@dataclass
class Step:
    name: str
    cmd: list[str]
    timeout: float = 60  # seconds: past it, the step and everything it started are stopped
    typical: float = 20  # seconds it is expected to take on a GPU host (what --list shows as "about")
    group: str = "targets"
    note: str = ""
    skip: str = ""  # why it does not run here ("" = it runs)
    expect: str = ""  # a regular expression its output must hold to pass (besides exit code 0)
    env: dict = field(default_factory=dict)


def make(target: str, **variables) -> list[str]:
    return ["make", "--no-print-directory", target] + [f"{k}={v}" for k, v in variables.items() if v is not None]


def can_make_netns() -> bool:
    """Root alone is not enough: a container without CAP_SYS_ADMIN (a typical rented GPU) refuses `ip netns add`."""
    import shutil

    if os.geteuid() != 0 or not shutil.which("ip"):
        return False
    name = f"ddp-probe-{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode != 0:
        return False
    subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    return True


def suite_workers(cores: int) -> int:
    """pytest workers for the suite beside the CUDA streams: three eighths of the cores, 2 to 8."""
    return min(8, max(2, cores * 3 // 8))


def plan(gpus: int, is_root: bool = True, scratch: str = "runs/gpu_check/scratch", cores: int = 16,
         py: str | None = None) -> list[Step]:
    """Every step for a machine with `gpus` GPUs and `cores` cores, in order: the figures, the suite, the CUDA
    steps. Pure: tests call it with any counts. `scratch` is where the benchmarks and the timeline write (read back
    into the report, then removed); `py` the interpreter of the suite (None: this one).

    The limits are about two to three times what a step is expected to take on a GPU host, where start-up
    dominates (importing torch, CUDA and NCCL set-up; the runs themselves are short).
    """
    if gpus < 1:
        return []
    many = gpus >= 2
    nproc = gpus if many else 2  # one GPU each with NCCL, or two processes sharing the one GPU through Gloo
    share = None if many else "--device cuda --backend gloo"
    shared_note = "" if many else "2 processes share the GPU through Gloo (NCCL needs 2 GPUs)"
    final = r"(?m)^final: .*world_size="

    def args(*words):
        return " ".join(w for w in words if w) or None

    figures = [
        Step("mnist-1gpu", make("smoke", DATASET="auto", ARGS="--epochs 2"), timeout=40, typical=20, expect=final,
             note="MNIST on one GPU: epoch time and accuracy (the goals need real MNIST, not the stand-in)"),
        Step("resnet18-precisions", make("bench-amp", BENCH_OUT=scratch, ARGS="--models resnet18 --rounds 2"),
             timeout=45, typical=25, note="ResNet-18 images/s in fp32, TF32, bf16, fp16"),
        # one world size (all the GPUs): each round launches spawn and torchrun once
        Step("ddp-throughput", make("bench-throughput", BENCH_OUT=scratch, NPROC=gpus if many else None,
                                    ARGS="--rounds 2 --steps 50"), timeout=75 if many else 40,
             typical=45 if many else 20,
             note=f"DDP at world size 1 against the bare loop{f'; DDP over {gpus} GPUs' if many else ''}"),
    ]
    if many:
        figures.append(Step("allreduce-busbw", make("bench-allreduce", NPROC=gpus, BENCH_OUT=scratch,
                                                    ARGS="--rounds 2"), timeout=40, typical=20,
                            note=f"all_reduce bus bandwidth over {gpus} GPUs"))
    for step in figures:
        step.group = "figures"
    suite = Step("suite", [py or sys.executable, "-m", "pytest", "-n", str(suite_workers(cores)), "tests", "-v",
                           "-p", "no:cacheprovider"], group="tests", timeout=COMMAND_LIMIT_S, typical=240,
                 expect=r"\d+ passed", note="the whole suite, the cuda and multigpu tests included")
    targets = [
        Step("dataparallel", make("dataparallel", EPOCHS=1, ARGS="--max-steps 50"), timeout=45, expect=final,
             note=f"nn.DataParallel over {gpus} GPU(s)" + ("" if many else ": one GPU, nothing to split")),
        # model parallelism wants 2 GPUs per process: with fewer than 4 its halves run on the CPU, which
        # --device cuda (the processes sharing one GPU) would refuse, so on one GPU it is left to the suite
        Step("ddp-basics", make("ddp-basics", NPROC=gpus // 2 if gpus >= 4 else nproc, ARGS=share,
                                DEMOS=None if many else "basic checkpoint process"), timeout=75, typical=35,
             note="; ".join(n for n in (shared_note, "" if gpus >= 4 else "model parallel needs 4 GPUs: "
                                        + ("its halves run on the CPU" if many else "the suite runs it")) if n)),
        Step("ddp-spawn", make("ddp-spawn", NPROC=nproc, EPOCHS=1, ARGS=args("--max-steps 50", share)), timeout=45,
             expect=rf"(?m)^final: .*world_size={nproc}\b", note=shared_note),
        Step("ddp-timeline", make("ddp-timeline", NPROC=nproc, ARGS=args(f"--output-dir {scratch}/timeline", share)),
             timeout=60, typical=30, note=shared_note),
        Step("ddp-torchrun", make("ddp-torchrun", NPROC=nproc, EPOCHS=1, ARGS=share), timeout=60, typical=25,
             expect=rf"(?m)^final: .*world_size={nproc}\b", note=shared_note),
        Step("ddp-torchrun NPROC=1", make("ddp-torchrun", NPROC=1, EPOCHS=1, ARGS="--max-steps 100"), timeout=45,
             expect=r"(?m)^final: .*world_size=1\b", note="NCCL at world size 1"),
        Step("init-check", make("init-check", NPROC=nproc, ARGS=share), timeout=40, typical=15,
             expect=rf"process group of {nproc} is OK", note=shared_note),
        Step("ddp-minimal", make("ddp-minimal", NPROC=gpus if many else 1), timeout=40, typical=15),
        Step("elastic-restart", make("elastic-restart", NPROC=nproc, FAIL_AT=40,
                                     ARGS=args("--epochs 2 --max-steps 30", share)), timeout=90, typical=45,
             expect=r"(bitwise identical|identical within \S+ \(trained on a GPU\)): True", note=shared_note),
        Step("launch-legacy", make("launch-legacy", NPROC=nproc, EPOCHS=1, ARGS=args("--max-steps 30", share)),
             timeout=45, expect=final, note=shared_note),
        Step("amp-syncbn", make("amp-syncbn", NPROC=nproc, EPOCHS=1, ARGS=args("--max-steps 50", share)), timeout=60,
             typical=25, expect=final, note=shared_note),
        Step("cifar-resnet", make("cifar-resnet", NPROC=nproc, ARGS=share), timeout=75, typical=35, expect=final,
             note=shared_note),
        # FSDP2 on CUDA shards over NCCL; processes sharing one GPU would need Gloo's CUDA all-gather and
        # reduce-scatter, so one GPU runs one process
        Step("fsdp", make("fsdp", NPROC=gpus, EPOCHS=1, ARGS="--max-steps 30"), timeout=45,
             expect=rf"(?m)^final: .*world_size={gpus}\b", note="" if many else "one GPU: one process (NCCL)"),
        Step("zero", make("zero", NPROC=nproc, EPOCHS=1, ARGS=args("--max-steps 30", share)), timeout=45,
             expect=final, note=shared_note),
        # the first step compiles (Triton kernels on a GPU): a minute at most for the ConvNet
        Step("compile", make("compile", NPROC=nproc, EPOCHS=1, ARGS=args("--max-steps 30", share)), timeout=120,
             typical=60, expect=final, note=shared_note),
    ]
    if many:  # what needs a GPU per process to be on CUDA at all; with one GPU these run on the CPU, in the suite
        nodes_proc = max(1, gpus // 2)
        targets += [Step("dp-shapes", make("dp-shapes"), timeout=40, typical=10)]
        targets += [Step(t, make(t, NNODES=2, NPROC=nodes_proc, EPOCHS=1, ARGS="--max-steps 30"), timeout=50,
                         typical=25, expect=final, note=f"2 nodes x {nodes_proc} GPU(s)")
                    for t in ("multinode-tcp", "multinode-file", "multinode-torchrun")]
        targets += [
            Step("multinode-spawn", make("multinode-spawn", PROCS="2,1" if gpus >= 3 else "1,1"), timeout=50,
                 typical=25),
            Step("multinode-netns", make("multinode-netns", NPROC=nodes_proc, EPOCHS=1, ARGS="--max-steps 30"),
                 timeout=60, typical=30, expect=final, skip="" if is_root else "needs root allowed to create "
                 "network namespaces"),
            Step("collectives", make("collectives", NPROC=nproc), timeout=40, typical=15),
            Step("p2p", make("p2p", NPROC=nproc), timeout=40, typical=15),
            Step("ddp-from-scratch", make("ddp-from-scratch", NPROC=nproc), timeout=45, typical=20),
            Step("hang-demo", make("hang-demo", NPROC=nproc), timeout=60, typical=30),
            Step("backend-matrix", make("backend-matrix", ARGS=f"--output-dir {scratch}"), timeout=45, typical=20),
            Step("bench-buckets", make("bench-buckets", NPROC=gpus, BENCH_OUT=scratch, QUICK="--quick"), timeout=45),
            Step("bench-hooks", make("bench-hooks", NPROC=gpus, BENCH_OUT=scratch, QUICK="--quick"), timeout=60,
                 typical=30),
            # the restart with the workaround, once (without it a run may hang until stress.py's own 180 s)
            Step("elastic-stress", make("elastic-stress", NPROC=nproc, RUNS=1, BENCH_OUT=scratch, ARGS="--sides on"),
                 timeout=120, typical=50, note="one restart, with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"),
        ]
    return figures + [suite] + targets


def parts(steps: list[Step]) -> dict[str, list[Step]]:
    """For a host with fewer cores (PART=): the figures, then the GPU tests (pytest -m "cuda or multigpu", split by
    file) and the CUDA steps, each group packed first-fit into parts whose limits stay within COMMAND_LIMIT_S; a
    group that fits in one part is named by itself (`figures`), else its parts are numbered (`targets-1`, ...).
    The suite's other tests are not run: `make test` runs them on any machine. A skipped step costs nothing."""
    gpu_tests = []
    for i, files in enumerate(filter(None, gpu_test_files()), 1):
        gpu_tests.append(Step(f"gpu-tests-{i}", [sys.executable, "-m", "pytest", "-m", "cuda or multigpu", *files,
                                                 "-q", "-p", "no:cacheprovider"], group="tests", timeout=420,
                              typical=200, expect=r"\d+ passed"))
    chosen = [s for s in steps if s.group != "tests"] + gpu_tests
    out = {}
    for group in GROUPS:
        chunks: list[list[Step]] = []
        for step in (s for s in chosen if s.group == group):
            cost = 0.0 if step.skip else step.timeout
            home = next((c for c in chunks if budget(c)[0] + cost <= COMMAND_LIMIT_S), None)
            if home is None:
                chunks.append(home := [])
            home.append(step)
        for i, chunk in enumerate(chunks, 1):
            out[group if len(chunks) == 1 else f"{group}-{i}"] = chunk
    return out


@dataclass
class OneCommand:
    figures: list[Step]
    streams: list[list[Step]]  # the suite's stream first

    @property
    def steps(self) -> list[Step]:
        return self.figures + [s for stream in self.streams for s in stream]


def one_command(steps: list[Step]) -> OneCommand:
    """The figures first, then the suite in a stream of its own and the CUDA steps in as few streams as it takes for
    each to stay within COMMAND_LIMIT_S with the figures (the longest limits placed first, each where it fills a
    stream best); within a stream the steps keep the plan's order."""
    figures = [s for s in steps if s.group == "figures"]
    room = COMMAND_LIMIT_S - budget(figures)[0]
    suite = [replace(s, timeout=room) for s in steps if s.group == "tests"]
    targets = [s for s in steps if s.group == "targets"]
    streams: list[list[Step]] = []
    for step in sorted(targets, key=lambda s: 0.0 if s.skip else -s.timeout):
        cost = 0.0 if step.skip else step.timeout
        fits = [c for c in streams if budget(c)[0] + cost <= room]
        home = max(fits, key=lambda c: budget(c)[0], default=None)
        if home is None:
            streams.append(home := [])
        home.append(step)
    return OneCommand(figures, [suite, *(sorted(c, key=targets.index) for c in streams)])


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
                                    "(or a group: figures, tests, targets; or all)")
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


class Stopped(Exception):
    """gpu-check itself was stopped (Ctrl-C, SIGTERM): the step that ran was stopped with what it started."""


def run_step(step: Step, tag: str | None = None, py: str | None = None, linger: float = 5.0,
             stop: threading.Event | None = None) -> dict:
    """Run one step in its own session, bounded by its time limit; stop everything it started when it runs out,
    or when `stop` is set (then raise Stopped). Processes still running `linger` seconds after it ended fail it.
    The row keeps the step's output only if it failed."""
    tag = tag or uuid.uuid4().hex
    start = time.time()
    # the output goes to a file, not a pipe: a process the step left behind would hold a pipe open, and reading
    # it to the end would wait for that process instead of for the step
    with tempfile.TemporaryFile() as output:
        proc = subprocess.Popen(step.cmd, cwd=REPO, env=step_env(step, tag, py), stdin=subprocess.DEVNULL,
                                stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        why = ""
        try:
            while proc.poll() is None:
                if stop is not None and stop.is_set():
                    raise Stopped(step.name)
                if time.time() - start > step.timeout:
                    stopped = stop_tagged(tag, proc.pid)
                    why = (f"ran past its limit of {step.timeout:.0f} s: stopped with the {len(stopped)} process(es) "
                           "it had started")
                    proc.wait()
                    break
                time.sleep(0.1)
        except BaseException:  # Stopped, or Ctrl-C / SIGTERM to gpu-check itself: leave nothing running
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
    row = {"step": step.name, "group": step.group, "passed": not why, "why": why or None, "started": round(start, 1),
           "seconds": round(seconds, 1), "timeout": step.timeout, "note": step.note, "command": shlex.join(step.cmd),
           "final": _final(out)}
    if step.group == "tests":
        row["tests"] = pytest_counts(out)
    if why:
        row["log"] = f"$ {shlex.join(step.cmd)}\n({why})\n{out}"
    return row


def skipped_row(step: Step) -> dict:
    return {"step": step.name, "group": step.group, "passed": False, "skipped": step.skip, "why": None,
            "started": round(time.time(), 1), "seconds": 0.0, "timeout": step.timeout, "note": step.note,
            "command": shlex.join(step.cmd), "final": {}}


def _final(text: str) -> dict:
    """The last `final:` line of a step's output, as a dict of strings."""
    lines = [ln for ln in text.splitlines() if ln.startswith("final: ")]
    return dict(p.split("=", 1) for p in lines[-1][len("final: "):].split() if "=" in p) if lines else {}


def pytest_counts(text: str) -> dict:
    """What a pytest run printed, test by test (-v, also under pytest-xdist), so that a run stopped at its limit
    still tells what it finished: {outcome: count} and the ids of the tests that failed."""
    words = "PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS"
    outcomes = re.findall(rf"^\[gw\d+\] \[ *\d+%\] ({words}) (tests/.+?) *$", text, re.M)  # pytest-xdist
    outcomes += [(o, t) for t, o in re.findall(rf"^(tests/.+?) ({words}) +\[ *\d+%\]$", text, re.M)]  # one process
    counts: dict = {}
    for outcome, _ in outcomes:
        counts[outcome.lower()] = counts.get(outcome.lower(), 0) + 1
    counts["failed_tests"] = sorted({t for o, t in outcomes if o in ("FAILED", "ERROR")})
    return counts


# ------------------------------------------------------------------ the rehearsal on the CPU

def rehearsed(step: Step, real: bool, real_args: str = "") -> Step:
    """The step as the rehearsal runs it: really, on the CPU (`--device cuda` and `--backend nccl` left out of
    ARGS, real_args added, no GPU visible), or dry: `make -n` (the target exists and takes these variables) or
    pytest --collect-only (the selection holds tests)."""
    if not real:
        if step.cmd[0] == "make":
            return replace(step, cmd=["make", "-n", *step.cmd[1:]], timeout=min(step.timeout, 30), expect="")
        cmd = [w for i, w in enumerate(step.cmd) if w not in ("-n", "-v", "-q") and (i == 0 or step.cmd[i - 1] != "-n")]
        return replace(step, cmd=[*cmd, "--collect-only", "-q"], timeout=min(step.timeout, 120),
                       expect=r"[1-9]\d* tests? collected|^tests/\S+::", typical=min(step.typical, 30))
    if step.cmd[0] != "make":
        raise course.UsageError(f"--real {step.name}: only make steps run for real in a rehearsal")
    cmd, has_args = [], False
    for word in step.cmd:
        if word.startswith("ARGS="):
            has_args = True
            word = re.sub(r"--device cuda|--backend nccl|--backend gloo", "", word)
            word = " ".join((word + " " + real_args).split())
        cmd.append(word)
    if not has_args and real_args:
        cmd.append(f"ARGS={real_args}")
    return replace(step, cmd=cmd, env={**step.env, "CUDA_VISIBLE_DEVICES": ""})


# ------------------------------------------------------------------ figures, goals, report

def benchmarks(scratch: Path) -> dict:
    """The results the figures' benchmarks wrote: name (amp, throughput, allreduce_sweep ...) -> its JSON."""
    found = {}
    for path in sorted(scratch.glob("*.json")) if scratch.exists() else []:
        try:
            found.setdefault(path.name.split("_")[0] if not path.name.startswith("allreduce_sweep")
                             else "allreduce_sweep", json.loads(path.read_text()))
        except (OSError, ValueError):
            pass
    return found


def figures(rows: list[dict], results: dict, gpus: int) -> dict:
    """The GPU figures a reader wants, from the steps' final lines and the benchmarks' results."""
    fig = {}
    single = next((r for r in rows if r["step"] == "mnist-1gpu" and r["passed"]), None)
    if single and single["final"]:
        f = single["final"]
        fig["mnist_one_gpu"] = {"dataset": f["dataset"], "epochs": int(f["epochs"]),
                                "test_acc": float(f["test_acc"]),
                                "seconds_per_epoch": float(f["seconds"]) / int(f["epochs"])}
    amp = results.get("amp")
    if amp:
        fig["resnet18_images_per_s"] = {p: amp["results"][f"resnet18/{p}"]["median"]
                                        for p in ("fp32", "tf32", "bf16", "fp16") if f"resnet18/{p}" in amp["results"]}
        fig["resnet18_vs_fp32"] = {k.split("/")[1].replace("_vs_fp32", ""): v["median"]
                                   for k, v in amp["ratios"].items() if k.startswith("resnet18/")}
    throughput = results.get("throughput")
    if throughput:
        fig["ddp_ws1_overhead"] = throughput["ratios"]["ddp_ws1_overhead"]["median"]
        fig["dataparallel_vs_plain"] = throughput["ratios"]["dataparallel_vs_plain"]["median"]
        fig["throughput_images_per_s"] = {k: v["median"] for k, v in throughput["results"].items()}
    sweep = results.get("allreduce_sweep")
    if sweep:
        fig["all_reduce_busbw_GBps"] = max(r["busbw_GBps"] for r in sweep["rows"] if r["op"] == "all_reduce")
    elif gpus < 2:
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


def machine(gpus: int, cores: int, rehearse: bool, py: str | None) -> dict:
    """What the results were measured on: the GPU and its driver, torch and the CUDA it was built with, the
    interpreter. A rehearsal says so, with the GPU and core counts it pretended."""
    import platform

    import torch

    device = torch.device("cpu") if rehearse else torch.device("cuda", 0)
    info = benchlib.machine_info(device, "nccl" if gpus >= 2 and not rehearse else None)
    info.update({"driver": None if rehearse else driver_version(), "torch_cuda": torch.version.cuda,
                 "executable": py or sys.executable, "python": platform.python_version(),
                 "rehearsal": {"gpus": gpus, "cores": cores} if rehearse else None})
    if rehearse:
        info["gpus"] = 0
    return info


def report_md(title: str, rows: list[dict], fig: dict, met: dict, info: dict, layout: list[tuple[str, list[str]]],
              failed: list[str], left: dict[str, str]) -> list[str]:
    md = [title, "", f"torch {info['torch']} (CUDA {info['torch_cuda']}), driver {info['driver']}, Python "
          f"{info['python']} ({info['executable']}), {info['cores']} CPU cores, {info['date']}.", "",
          f"Result: {'FAILED: ' + ', '.join(failed) if failed else 'every step passed or was not for this machine'}."]
    if fig:
        md += ["", "## Figures", ""]
        md += benchlib.md_table(["figure", "value"], [[k, json.dumps(v)] for k, v in fig.items()])
        md += ["", "Goals:", ""]
        md += benchlib.md_table(["goal", "met"], [[k, {True: "yes", False: "no", None: "not measured"}[v]]
                                                   for k, v in met.items()])
    by_name = {r["step"]: r for r in rows}
    for heading, names in layout:
        shown = [by_name[n] for n in names if n in by_name]
        if not shown:
            continue
        md += ["", f"## {heading}", ""]
        md += benchlib.md_table(["step", "result", "seconds", "limit", "note"],
                                [[r["step"], "passed" if r["passed"] else ("not run" if r.get("skipped") else "FAILED"),
                                  f"{r['seconds']:.0f}", f"{r['timeout']:.0f}",
                                  r.get("why") or r["note"] or r.get("skipped") or ""] for r in shown])
    for r in rows:
        if "tests" in r:
            t = r["tests"]
            counts = ", ".join(f"{t[k]} {k}" for k in ("passed", "failed", "error", "skipped") if t.get(k))
            md += ["", f"{r['step']}: {counts or 'no test reported'}"]
            md += [f"- failed: `{n}`" for n in t["failed_tests"]]
    md += ["", "Not steps here (the suite runs them, or they are recorded on the CPU): "
           + "; ".join(f"`{k}` ({v})" for k, v in left.items()) + "."]
    return md


class Report:
    """The one folder's files: NAME.json, NAME.md and, when a step failed, NAME_logs.tar.gz. Written again after
    every step (from any stream), so a command cut off from outside keeps what it finished."""

    def __init__(self, out_dir: Path, name: str, title: str, info: dict, gpus: int, scratch: Path,
                 layout: list[tuple[str, list[str]]], extra: dict):
        self.out_dir, self.name, self.title, self.info, self.gpus, self.scratch = out_dir, name, title, info, gpus, \
            scratch
        self.layout, self.extra, self.rows, self.lock = layout, extra, [], threading.Lock()

    def add(self, row: dict) -> None:
        with self.lock:
            self.rows.append(row)
            self.write()

    def failed(self) -> list[str]:
        return [r["step"] for r in self.rows if not r["passed"] and not r.get("skipped")]

    def write(self) -> list[Path]:
        results = benchmarks(self.scratch)
        fig = figures(self.rows, results, self.gpus)
        met = goals(fig)
        rows = [{k: v for k, v in r.items() if k != "log"} for r in self.rows]
        payload = {"bench": "gpu_check", "machine": self.info, **self.extra, "steps": rows, "figures": fig,
                   "goals": met, "failed": self.failed(), "run_by_the_suite": left_to_the_suite(self.gpus),
                   "benchmarks": results}
        md = report_md(self.title, self.rows, fig, met, self.info, self.layout, self.failed(),
                       left_to_the_suite(self.gpus))
        self.out_dir.mkdir(parents=True, exist_ok=True)
        paths = [course.atomic_write_bytes((json.dumps(payload, indent=1, default=str) + "\n").encode(),
                                           self.out_dir / f"{self.name}.json"),
                 course.atomic_write_bytes(("\n".join(md) + "\n").encode(), self.out_dir / f"{self.name}.md")]
        logs = [r for r in self.rows if r.get("log")]
        if logs:
            buffer = io.BytesIO()
            with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
                for r in logs:
                    data = r["log"].encode()
                    info = tarfile.TarInfo(f"{self.name}_logs/{re.sub(r'[^A-Za-z0-9_.=-]+', '_', r['step'])}.log")
                    info.size, info.mtime = len(data), int(time.time())
                    tar.addfile(info, io.BytesIO(data))
            paths.append(course.atomic_write_bytes(buffer.getvalue(), self.out_dir / f"{self.name}_logs.tar.gz"))
        return paths


# ------------------------------------------------------------------ listing and running

def show_one(cmd: OneCommand, gpus: int, cores: int) -> None:
    figs = budget(cmd.figures)
    course.say(f"gpu-check on {gpus} GPU(s) and {cores} cores: one command; the figures and any one stream have "
               f"time limits of at most {COMMAND_LIMIT_S} s together")
    course.say(f"\nfigures, one after another on the idle GPU: {len(cmd.figures)} step(s), time limits {figs[0]:.0f} s,"
               f" about {figs[1]:.0f} s")
    for s in cmd.figures:
        course.say(f"  {s.name:<24} {shlex.join(s.cmd)}   (limit {s.timeout:.0f} s)" + (f"   [{s.note}]" if s.note
                                                                                         else ""))
    course.say(f"\nthen {len(cmd.streams)} streams side by side:")
    for i, stream in enumerate(cmd.streams, 1):
        limit, typical = budget(stream)
        course.say(f"stream {i}: {len(stream)} step(s), time limits {limit:.0f} s, about {typical:.0f} s")
        for s in stream:
            note = f"   [{s.note}]" if s.note and not s.skip else ""
            course.say(f"  {s.name:<24} {s.skip or shlex.join(s.cmd)}   (limit {s.timeout:.0f} s){note}")
    course.say("\nnot steps here (the suite runs them, or they are recorded on the CPU): "
               + ", ".join(left_to_the_suite(gpus)))


def show_parts(all_parts: dict[str, list[Step]], gpus: int) -> None:
    course.say(f"gpu-check on {gpus} GPU(s) in parts: {len(all_parts)} parts, each within {COMMAND_LIMIT_S} s of "
               f"time limits (run one with make gpu-check PART=NAME; PART=all runs them all)")
    for part, steps in all_parts.items():
        limit, typical = budget(steps)
        course.say(f"\n{part}: {len(steps)} step(s), time limits {limit:.0f} s, about {typical:.0f} s")
        for s in steps:
            note = f"   [{s.note}]" if s.note and not s.skip else ""
            course.say(f"  {s.name:<24} {s.skip or shlex.join(s.cmd)}   (limit {s.timeout:.0f} s){note}")


def output_dir(record: bool, given: str | None = None) -> Path:
    """Where results go: runs/gpu_check (git ignores it), bench/results when recording, or the folder given."""
    return Path(given).resolve() if given else REPO / ("bench/results" if record else "runs/gpu_check")


def _stop_on_sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run_steps(steps: list[Step], report: Report, prepare, stop: threading.Event, py: str | None, label: str) -> None:
    """One stream: its steps one after another, each row into the report as it ends."""
    for i, step in enumerate(steps, 1):
        if stop.is_set():
            return
        if step.skip:
            report.add(skipped_row(step))
            course.say(f"[{label} {i}/{len(steps)}] {step.name}: {step.skip}")
            continue
        try:
            row = run_step(prepare(step), py=py, stop=stop)
        except Stopped:
            report.add({**skipped_row(step), "skipped": "", "why": "gpu-check was stopped, and every process the "
                        "step had started"})
            return
        report.add(row)
        course.say(f"[{label} {i}/{len(steps)}] {step.name}: {'passed' if row['passed'] else 'FAILED'} in "
                   f"{row['seconds']:.0f} s" + (f" ({row['why']})" if row["why"] else ""))


def run_one_command(cmd: OneCommand, report: Report, prepare, py: str | None, label: str = "figures") -> int:
    """The figures one after another, then the streams in threads; Ctrl-C or SIGTERM stops every running step."""
    stop = threading.Event()
    threads: list[threading.Thread] = []
    try:
        run_steps(cmd.figures, report, prepare, stop, py, label)
        if cmd.streams:
            course.say(f"--- {len(cmd.streams)} streams side by side")
        threads = [threading.Thread(target=run_steps, args=(stream, report, prepare, stop, py, f"stream {i}"),
                                    daemon=True) for i, stream in enumerate(cmd.streams, 1)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            time.sleep(0.2)
    except KeyboardInterrupt as signal_:
        stop.set()
        for t in threads:
            t.join(timeout=30)
        report.add({"step": "(gpu-check)", "group": "", "passed": False, "why": f"stopped ({signal_ or 'Ctrl-C'}), "
                    "with every process its steps had started", "seconds": 0.0, "timeout": 0, "note": "",
                    "command": "", "final": {}})
        course.say(f"stopped; what it finished is in {report.out_dir / report.name}.json")
        return 130
    report.write()
    return 1 if report.failed() else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", default="auto", help="auto (default: the one command on a host with 8 cores or "
                        "more, else the list of parts), one, list, a part, a group (figures, tests, targets), or all;"
                        " comma-separated")
    parser.add_argument("--list", action="store_true", help="show the plan (the one command, the parts); run nothing")
    parser.add_argument("--record", action="store_true", help="write into bench/results (default: runs/gpu_check)")
    parser.add_argument("--output-dir", help="write here instead")
    parser.add_argument("--only", default="", help="comma-separated step names: run only these")
    parser.add_argument("--gpus", type=course.positive_int, help="with --list or --rehearse: pretend N GPUs")
    parser.add_argument("--cores", type=course.positive_int, help="with --list or --rehearse: pretend N CPU cores")
    parser.add_argument("--py", help="the interpreter every step uses (make gpu-check PY=... gives it)")
    parser.add_argument("--rehearse", action="store_true", help="run the plan for --gpus N here, on the CPU: "
                        "make -n, pytest --collect-only, and the --real steps for real")
    parser.add_argument("--real", default="", help="with --rehearse: comma-separated steps that really run")
    parser.add_argument("--real-args", default="", help="with --rehearse: added to ARGS of the --real steps")
    parser.add_argument("--limit", action="append", default=[], metavar="STEP=SECONDS",
                        help="a step's time limit instead of its own (repeatable)")
    args = parser.parse_args(argv)
    if (args.gpus or args.cores) and not (args.list or args.rehearse):
        parser.error("--gpus and --cores go with --list or --rehearse: a real check uses what is here")
    if args.rehearse and not args.gpus:
        parser.error("--rehearse needs --gpus N: the GPU count to pretend")
    if (args.real or args.real_args) and not args.rehearse:
        parser.error("--real and --real-args go with --rehearse")
    limits = {}
    for item in args.limit:
        name, _, seconds = item.rpartition("=")
        try:
            limits[name] = float(seconds)
        except ValueError:
            parser.error(f"--limit {item!r}: expected STEP=SECONDS")
    gpus = args.gpus or common.usable_gpus()
    cores = args.cores or benchlib.usable_cores()
    if gpus == 0:
        parser.exit(2, "error: gpu-check needs a CUDA GPU, and torch sees none here (torch.cuda.is_available() is "
                       "False). `--list --gpus 1` shows what it would run, `--rehearse --gpus 1` rehearses it on "
                       "the CPU.\n")
    out_dir = output_dir(args.record, args.output_dir)
    os.chdir(REPO)  # every step is a command of the course, run from its root
    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-")) if not args.list else Path("runs/gpu_check/scratch")
    steps = plan(gpus, is_root=True, scratch=str(scratch), cores=cores, py=args.py)
    unknown = {*limits, *filter(None, args.only.split(",")), *filter(None, args.real.split(","))} \
        - {s.name for s in steps} - {f"gpu-tests-{i}" for i in (1, 2)}
    if unknown:
        parser.error(f"no step {sorted(unknown)} here; --list shows them")
    netns = can_make_netns() if not args.list else True
    for s in steps:
        s.timeout = limits.get(s.name, s.timeout)
        if s.name == "multinode-netns" and not netns:
            s.skip = "needs root allowed to create network namespaces"
    cmd = one_command(steps)
    for s in cmd.streams[0]:  # the suite's limit is the room a stream has; --limit still wins
        s.timeout = limits.get(s.name, s.timeout)
    all_parts = parts(steps)
    for part in all_parts.values():
        for s in part:
            s.timeout = limits.get(s.name, s.timeout)
    if args.list:
        show_one(cmd, gpus, cores)
        course.say("")
        show_parts(all_parts, gpus)
        return 0
    mode = args.part
    if mode == "auto":
        mode = "one" if cores >= ONE_COMMAND_CORES else "list"
        if mode == "list":
            course.say(f"this host has {cores} cores: the one command needs {ONE_COMMAND_CORES} or more to run its "
                       "streams side by side; run the parts one by one (make gpu-check PART=NAME):\n")
    if mode == "list":
        show_parts(all_parts, gpus)
        return 0
    only = set(filter(None, args.only.split(",")))
    real = set(filter(None, args.real.split(",")))
    py = args.py

    def prepare(step: Step) -> Step:
        return rehearsed(step, step.name in real, args.real_args) if args.rehearse else step

    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    import torch

    info = machine(gpus, cores, args.rehearse, py)
    where = (f"rehearse{gpus}gpu{cores}cores_{benchlib.machine_tag(torch.device('cpu'))}" if args.rehearse
             else f"{benchlib.machine_tag(torch.device('cuda', 0))}x{gpus}")
    date = time.strftime("%Y-%m-%d")
    title = (f"# GPU check rehearsal: {gpus} pretended GPU(s), {cores} pretended cores, on the CPU" if args.rehearse
             else f"# GPU check: {gpus} x {info['gpu']}")
    try:
        if mode == "one":
            kept = OneCommand([s for s in cmd.figures if not only or s.name in only],
                              [[s for s in st if not only or s.name in only] for st in cmd.streams])
            kept.streams = [st for st in kept.streams if st]
            layout = [("Figures, on the idle GPU", [s.name for s in kept.figures])] + \
                     [(f"Stream {i}", [s.name for s in st]) for i, st in enumerate(kept.streams, 1)]
            report = Report(out_dir, f"gpu_check_{where}_{date}", title, info, gpus, scratch, layout,
                            {"mode": "one command", "streams": len(kept.streams),
                             "suite_workers": suite_workers(cores), "limit_s": COMMAND_LIMIT_S})
            course.say(f"--- gpu-check: figures ({len(kept.figures)} steps), then {len(kept.streams)} streams; "
                       f"results in {out_dir}")
            code = run_one_command(kept, report, prepare, py)
        else:
            try:
                names = select(all_parts, mode)
            except course.UsageError as err:
                parser.error(str(err))
            code = 0
            for part in names:
                chosen = [s for s in all_parts[part] if not only or s.name in only]
                report = Report(out_dir, f"gpu_check_{part}_{where}_{date}", f"{title}, part {part}", info, gpus,
                                scratch, [(f"Part {part}", [s.name for s in chosen])],
                                {"mode": "part", "part": part, "limit_s": COMMAND_LIMIT_S})
                course.say(f"--- part {part}: {len(chosen)} step(s), time limits {budget(chosen)[0]:.0f} s")
                code = max(code, run_one_command(OneCommand(chosen, []), report, prepare, py, label=part))
                if code == 130:
                    break
        failed = report.failed()
        written = [p for p in (report.out_dir / f"{report.name}{s}" for s in (".json", ".md", "_logs.tar.gz"))
                   if p.exists()]
        course.say(f"{'failed: ' + ', '.join(failed) if failed else 'every step passed or was not for this machine'}"
                   f". Written: {', '.join(map(str, written))}")
        return code
    finally:
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
