"""make gpu-check: what runs where, in one command or in parts, within which time limits; and its rehearsal on this
CPU machine for a pretended GPU and core count (dry runs of every step, two steps for real, one of them past its
limit)."""

import _thread
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import threading
import time
import uuid
from pathlib import Path

import pytest

import common
import harness
from harness import PYTHON, REPO, run
from tools import course

sys.path.insert(0, str(REPO / "bench"))
import gpu_check  # noqa: E402

# `make test PY=...` passes PY to every make below it through MAKEFLAGS: a dry run that reads its own flags is
# started without what the outer make left in the environment
WITHOUT_OUTER_MAKE = {k: v for k, v in os.environ.items() if k not in harness.OUTER_MAKE}

NOT_RUN_BY_GPU_CHECK = {"help", "setup", "data", "test", "test-fast", "notebooks", "diffs", "mutants", "lint", "clean",
                        "distclean", "check-nproc", "check-nnodes", "bench", "bench-quick", "gpu-check",
                        "bench-versions",  # CPU only: two versions of the course against each other
                        "compat",  # CPU only: the course on another torch release, from the package index
                        "doctor",  # a check-up of the user's own script, which names it
                        "existing-python"}  # the setup step of PY=python3
ONE_COMMAND_S = 600  # what a borrowed GPU machine gives one command
CORES = 16  # a typical rented GPU host


def make_targets() -> set[str]:
    makefile = (REPO / "Makefile").read_text().replace("\\\n", " ")
    return set(" ".join(re.findall(r"^\.PHONY:(.*)$", makefile, re.M)).split())


def var(step, name):
    return next((a.split("=", 1)[1] for a in step.cmd if a.startswith(name + "=")), None)


@pytest.mark.parametrize("gpus", [0, 1, 2, 8])
def test_gpu_check_plans_every_target_for_the_gpus_present(gpus, monkeypatch):
    """Every example target is a step, or left to the suite with the reason, and the suite really runs those."""
    steps = gpu_check.plan(gpus, is_root=False, cores=CORES)
    if gpus == 0:
        assert steps == []
        return
    by_target = {}
    for step in steps:
        if step.cmd[0] == "make":
            by_target.setdefault(step.cmd[2], []).append(step)
    left = gpu_check.left_to_the_suite(gpus)
    by_target.pop("smoke")  # the figures' MNIST on one GPU
    assert not set(by_target) & set(left), "a step is not also left to the suite"
    assert set(by_target) | set(left) == make_targets() - NOT_RUN_BY_GPU_CHECK - {"smoke"}
    tests = "\n".join(p.read_text() for p in (REPO / "tests").glob("test_*.py"))
    records = {p.name for p in (REPO / "bench/results").glob("*.json")}
    for target in left:  # a test of the suite names it, or it is a repeated run recorded on the CPU
        record = {"free-stress": "stress_free_", "bench-memory": "memory_"}.get(target)
        assert re.search(rf"""["']{target}["']""", tests) or (record and any(r.startswith(record) for r in records)), \
            f"{target} is not a step, and neither the suite nor a record runs it"
    suite = [s for s in steps if s.group == "tests"]
    assert len(suite) == 1 and suite[0].cmd[1:5] == ["-m", "pytest", "-n", str(gpu_check.suite_workers(CORES))]
    assert "tests" in suite[0].cmd and "-m" not in suite[0].cmd[2:], "the whole suite: no marker selection"
    if gpus == 1:  # several processes share the one GPU through Gloo
        assert var(by_target["ddp-torchrun"][0], "NPROC") == "2"
        assert var(by_target["ddp-torchrun"][0], "ARGS") == "--device cuda --backend gloo"
        assert "collectives" in left and "bench-allreduce" in left
    else:  # one process per GPU with NCCL
        assert var(by_target["ddp-torchrun"][0], "NPROC") == str(gpus)
        assert var(by_target["ddp-torchrun"][0], "ARGS") is None
        assert var(by_target["bench-allreduce"][0], "NPROC") == str(gpus)
        assert var(by_target["multinode-tcp"][0], "NPROC") == str(gpus // 2), "2 nodes x NPROC: one GPU per process"
        assert by_target["multinode-netns"][0].skip == "needs root allowed to create network namespaces"
        assert not gpu_check.plan(gpus, is_root=True)[[s.name for s in steps].index("multinode-netns")].skip
    # every ddp-basics step that runs the model-parallel demo asks for a placement this machine can give
    monkeypatch.syspath_prepend(str(REPO / "02_ddp_spawn"))
    import ddp_basics

    basics = by_target["ddp-basics"][0]
    demos = (var(basics, "DEMOS") or "basic checkpoint model-parallel process").split()
    assert ("model-parallel" in demos) == (gpus >= 2)
    if "model-parallel" in demos:
        flags = dict(zip(*[iter((var(basics, "ARGS") or "").split())] * 2, strict=True))
        monkeypatch.setattr(common, "usable_gpus", lambda: gpus)
        ddp_basics.model_parallel_placement(flags.get("--device", "auto"), flags.get("--backend"),
                                            int(var(basics, "NPROC")))


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_the_one_command_fits_its_limits(gpus, capsys):
    """The figures' limits plus those of any one stream add up to at most COMMAND_LIMIT_S, which leaves two minutes
    of the 10 a borrowed GPU machine gives one command; the figures come first and are the figures; the suite has a
    stream of its own; every step is in exactly one place, in the plan's order within its stream."""
    steps = gpu_check.plan(gpus, is_root=True, cores=CORES)
    cmd = gpu_check.one_command(steps)
    assert gpu_check.COMMAND_LIMIT_S <= ONE_COMMAND_S - 60 - 60  # and a minute more for the start and the report
    figures = gpu_check.budget(cmd.figures)[0]
    assert [s.name for s in cmd.figures] == ["mnist-1gpu", "resnet18-precisions", "ddp-throughput"] + \
        (["allreduce-busbw"] if gpus >= 2 else [])
    assert [s.name for s in cmd.streams[0]] == ["suite"] and len(cmd.streams) >= 2
    for stream in cmd.streams:
        limits, typical = gpu_check.budget(stream)
        assert 0 < figures + limits <= gpu_check.COMMAND_LIMIT_S, (figures, limits)
        order = [steps.index(next(x for x in steps if x.name == s.name)) for s in stream]
        assert order == sorted(order)
    names = [s.name for s in cmd.steps]
    assert sorted(names) == sorted(s.name for s in steps) and len(set(names)) == len(names)
    assert all(s.typical < s.timeout for s in cmd.steps)
    gpu_check.show_one(cmd, gpus, CORES)
    listed = capsys.readouterr().out
    for i, stream in enumerate(cmd.streams, 1):
        assert re.search(rf"^stream {i}: {len(stream)} step\(s\), time limits {gpu_check.budget(stream)[0]:.0f} s",
                         listed, re.M), listed
    assert re.search(r"^  elastic-restart\s+make --no-print-directory elastic-restart .*\(limit 90 s\)", listed, re.M)


@pytest.mark.parametrize("gpus", [1, 8])
def test_a_host_with_fewer_cores_runs_the_same_steps_in_parts(gpus):
    """PART=: every step but the suite, in parts of at most COMMAND_LIMIT_S; the GPU tests instead of the suite,
    split by file, every file with a GPU test in exactly one part."""
    steps = gpu_check.plan(gpus, is_root=True, cores=4)
    parts = gpu_check.parts(steps)
    for name, part in parts.items():
        assert 0 < gpu_check.budget(part)[0] <= gpu_check.COMMAND_LIMIT_S, name
    in_parts = [s.name for p in parts.values() for s in p]
    assert sorted(n for n in in_parts if not n.startswith("gpu-tests")) == sorted(s.name for s in steps
                                                                                   if s.name != "suite")
    files = [a for p in parts.values() for s in p if s.name.startswith("gpu-tests") for a in s.cmd
             if a.startswith("tests/")]
    marked = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py")
                    if re.search(r"@pytest\.mark\.(cuda|multigpu)\b", p.read_text()))
    assert sorted(files) == marked, "every test file with GPU tests, each in one part"
    assert list(parts)[0] == "figures" and any(n.startswith("targets") for n in parts)


def test_a_part_is_chosen_by_name_by_group_or_all():
    parts = gpu_check.parts(gpu_check.plan(8))
    assert gpu_check.select(parts, "targets-2") == ["targets-2"]
    assert gpu_check.select(parts, "tests") == ["tests-1", "tests-2"]
    assert gpu_check.select(parts, "figures,tests-2,figures") == ["figures", "tests-2"]
    assert gpu_check.select(parts, "all") == list(parts)
    with pytest.raises(course.UsageError, match="no such part here"):
        gpu_check.select(parts, "targets-99")


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_every_make_step_exists_and_takes_its_variables(gpus):
    """`make -n` with the step's variables, as the GPU machine will run it: the target exists, the variables
    parse, the preflight is not asked for something it refuses before it starts."""
    for step in gpu_check.plan(gpus, is_root=True):
        if step.cmd[0] != "make":
            continue
        dry = subprocess.run(["make", "-n", *step.cmd[1:]], cwd=REPO, capture_output=True, text=True, timeout=60,
                             env=WITHOUT_OUTER_MAKE)
        assert dry.returncode == 0, (step.name, dry.stderr)
        assert "No rule to make target" not in dry.stderr, step.name


@pytest.mark.slow
def test_every_pytest_selection_holds_tests():
    """The GPU-test parts of a smaller host, as `pytest --collect-only` sees them here: neither is empty, none holds
    a test twice, and every test this run collected marked cuda or multigpu is in one of them (the suite's own
    step is collected by the rehearsal below)."""
    steps = gpu_check.plan(8, is_root=True, cores=CORES)
    pytests = [s for p in gpu_check.parts(steps).values() for s in p if s.name.startswith("gpu-tests")]
    assert [s.name for s in pytests] == ["gpu-tests-1", "gpu-tests-2"]
    marked = []
    for step in pytests:
        dry = gpu_check.rehearsed(step, real=False)
        res = run([PYTHON, *dry.cmd[1:]], timeout=120)
        collected = [line for line in res.stdout.splitlines() if line.startswith("tests/")]
        assert re.search(dry.expect, res.stdout, re.M) and collected, (step.name, res.tail())
        marked += collected
    assert len(set(marked)) == len(marked)
    # every test marked cuda or multigpu that this run collected (make test: all of them) is in one of the parts
    assert {node for node, needs_gpu in harness.COLLECTED.items() if needs_gpu} <= set(marked)


def test_the_output_patterns_it_reads_are_what_the_scripts_print():
    """Each step's pattern against a line as its script prints it, and that line's fixed words in the script."""
    final = "final: test_acc=0.9871 test_samples=10000 world_size=2 epochs=1 seconds=12.4 dataset=mnist-standin"
    printed = {"init-check": ("process group of 2 is OK: all_reduce of ones = 2", "03_ddp_torchrun/init_check.py",
                              ["process group of {world_size} is {'OK'"]),
               "elastic-restart": ("epochs 2 and 2: 8 tensors, bitwise identical: True, largest difference 0",
                                   "03_ddp_torchrun/compare_checkpoints.py",
                                   ["bitwise identical: {equal}", "identical within {args.gpu_atol:g} (trained on a "
                                    "GPU): {equal}"]),
               "suite": ("=== 312 passed, 16 skipped in 81.20s ===", None, [])}
    steps = {s.name: s for s in gpu_check.plan(2)}
    checked = 0
    for name, step in steps.items():
        if not step.expect:
            continue
        nproc = var(step, "NPROC") or "2"
        line, script, words = printed.get(name, (final.replace("world_size=2", f"world_size={nproc}"), None, []))
        assert re.search(step.expect, line), name
        broken = line
        for good, bad in (("True", "False"), (" passed", ""), ("final:", "finally:"), ("OK", "broken")):
            broken = broken.replace(good, bad)
        assert not re.search(step.expect, broken), f"{name}: the pattern must be able to fail"
        if f"world_size={nproc}" in step.expect:  # the world size is pinned: another one fails
            assert not re.search(step.expect, line.replace(f"world_size={nproc}", f"world_size={nproc}0")), name
        for word in words:
            assert word in (REPO / script).read_text(), (name, word)
        checked += 1
    assert checked >= 12
    assert re.search(steps["elastic-restart"].expect, "identical within 1e-05 (trained on a GPU): True, largest")
    for script in ("01_dataparallel/mnist_single.py", "01_dataparallel/mnist_dataparallel.py",
                   "02_ddp_spawn/mnist_spawn.py", "03_ddp_torchrun/mnist_torchrun.py", "04_multinode_tcp/mnist_tcp.py",
                   "06_amp_syncbn/cifar_resnet.py", "06_amp_syncbn/mnist_amp_syncbn.py"):
        text = (REPO / script).read_text()
        assert 'print(f"final: test_acc=' in text and "world_size={world_size}" in text, script


def test_the_suite_is_read_test_by_test_also_when_it_is_stopped():
    """pytest -v, under pytest-xdist or not: the counts and the failed tests' ids (which may hold spaces)."""
    xdist = ("[gw1] [  6%] PASSED tests/test_a.py::test_x[good-None] \n"
             "[gw0] [ 13%] FAILED tests/test_a.py::test_y[is not stated in a sentence] \n"
             "[gw1] [ 20%] SKIPPED tests/test_b.py::test_z \n")
    assert gpu_check.pytest_counts(xdist) == {"passed": 1, "failed": 1, "skipped": 1, "failed_tests": [
        "tests/test_a.py::test_y[is not stated in a sentence]"]}
    alone = "tests/test_a.py::test_x PASSED [ 50%]\ntests/test_a.py::test_y ERROR [100%]\n"
    assert gpu_check.pytest_counts(alone) == {"passed": 1, "error": 1, "failed_tests": ["tests/test_a.py::test_y"]}


def test_results_go_to_runs_unless_recorded_or_told():
    assert gpu_check.output_dir(record=False) == REPO / "runs" / "gpu_check"
    assert gpu_check.output_dir(record=True) == REPO / "bench" / "results"
    assert gpu_check.output_dir(record=False, given="/tmp/x") == Path("/tmp/x")
    for gpus in (1, 8):  # every step that writes files writes them into the scratch folder, read back, then removed
        commands = [" ".join(s.cmd) for s in gpu_check.plan(gpus, scratch="SCRATCH")]
        assert not [c for c in commands if "bench/results" in c]
        writers = [c for c in commands if "BENCH_OUT=" in c or "--output-dir" in c]
        assert len(writers) >= (3 if gpus == 1 else 7) and all("SCRATCH" in c for c in writers), writers
    for extra, flags in (([], []), (["RECORD=1"], ["--record"]), (["OUT_DIR=/tmp/o"], ["--output-dir", "/tmp/o"]),
                         (["PART=targets-1"], ["--part", "targets-1"])):
        dry = subprocess.run(["make", "--no-print-directory", "-n", "gpu-check", *extra], cwd=REPO,
                             capture_output=True, text=True, timeout=60,
                             env=WITHOUT_OUTER_MAKE).stdout.replace("\\\n", " ")
        words = dry[dry.index("bench/gpu_check.py"):].split()[1:]
        assert words == flags, (extra, dry)


def test_gpu_check_figures_and_goals_come_from_the_runs():
    from gpu_check import figures, goals

    results = {
        "amp": {"results": {f"resnet18/{p}": {"median": v} for p, v in (("fp32", 1000.0), ("tf32", 2500.0),
                                                                        ("bf16", 4000.0), ("fp16", 4200.0))},
                "ratios": {f"resnet18/{p}_vs_fp32": {"median": r} for p, r in (("tf32", 2.5), ("bf16", 4.0))}},
        "throughput": {"results": {"plain": {"median": 9000.0}, "ddp_ws1": {"median": 8600.0}},
                       "ratios": {"ddp_ws1_overhead": {"median": 0.05}, "dataparallel_vs_plain": {"median": 0.97}}}}
    rows = [{"step": "mnist-1gpu", "passed": True, "final": {"dataset": "mnist", "epochs": "2",
                                                             "test_acc": "0.9851", "seconds": "3.0"}}]
    fig = figures(rows, results, gpus=1)
    assert fig["mnist_one_gpu"] == {"dataset": "mnist", "epochs": 2, "test_acc": 0.9851, "seconds_per_epoch": 1.5}
    assert fig["resnet18_images_per_s"]["bf16"] == 4000.0 and fig["resnet18_vs_fp32"]["bf16"] == 4.0
    assert fig["ddp_ws1_overhead"] == 0.05 and fig["all_reduce_busbw_GBps"] == "not run: needs 2 GPUs"
    assert fig["throughput_images_per_s"] == {"plain": 9000.0, "ddp_ws1": 8600.0}
    assert "all_reduce_busbw_GBps" not in figures(rows, results, gpus=2), "2 GPUs whose sweep did not run"
    sweep = {"allreduce_sweep": {"rows": [{"op": "all_reduce", "busbw_GBps": 150.0},
                                          {"op": "all_reduce", "busbw_GBps": 310.5}, {"op": "broadcast",
                                                                                      "busbw_GBps": 400.0}]}}
    assert figures(rows, sweep, gpus=8)["all_reduce_busbw_GBps"] == 310.5
    assert goals(fig) == {"mnist_test_acc >= 0.98": True, "mnist_epoch_s < 2": True, "resnet18 bf16 >= 2x fp32": True}
    rows[0]["final"]["dataset"] = "mnist-standin"  # no MNIST on the machine: its figures are shown, not judged
    standin = figures(rows, results, gpus=1)
    assert standin["mnist_one_gpu"]["dataset"] == "mnist-standin"
    assert goals(standin)["mnist_test_acc >= 0.98"] is None and goals(standin)["mnist_epoch_s < 2"] is None
    assert set(goals({}).values()) == {None}, "a goal that was not measured is not called met"


def test_gpu_check_says_so_on_a_machine_without_gpus():
    res = run([PYTHON, REPO / "bench/gpu_check.py"], env={"CUDA_VISIBLE_DEVICES": ""}, expect_rc=2)
    assert "gpu-check needs a CUDA GPU" in res.stderr and "--rehearse --gpus 1" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.slow
def test_the_rehearsal_runs_the_one_command_with_its_streams_side_by_side(data_dir, tmp_path):
    """The one command for 1 GPU and 16 cores, on this CPU: every step dry (make -n, pytest --collect-only) but
    ddp-minimal, which trains the smallest program for real, and compile, which runs for real and past a limit of
    4 s. The
    streams run side by side; compile is stopped with every process it started (the harness finds none left); the
    report is still written: one folder of 3 files, the JSON and the markdown with every step, and the log of the
    step that failed; exit code 1."""
    out = tmp_path / "out"
    before = sorted(p.name for p in (REPO / "bench/results").iterdir())
    res = run([PYTHON, REPO / "bench/gpu_check.py", "--rehearse", "--gpus", "1", "--cores", str(CORES),
               "--py", PYTHON, "--real", "ddp-minimal,compile", "--limit", "compile=4", "--real-args",
               f"--max-steps 3 --dataset mnist-standin --data-dir {data_dir}", "--output-dir", out], timeout=240,
              expect_rc=1)
    name = f"gpu_check_rehearse1gpu{CORES}cores_cpu{gpu_check.benchlib.usable_cores()}_{time.strftime('%Y-%m-%d')}"
    assert sorted(p.name for p in out.iterdir()) == [f"{name}.json", f"{name}.md", f"{name}_logs.tar.gz"], res.tail()
    record = json.loads((out / f"{name}.json").read_text())
    plan = gpu_check.one_command(gpu_check.plan(1, is_root=True, cores=CORES))
    rows = {r["step"]: r for r in record["steps"]}
    assert sorted(rows) == sorted(s.name for s in plan.steps), "every step of the plan ran or was skipped"
    assert record["streams"] == len(plan.streams) and record["failed"] == ["compile"], record["failed"]
    assert all(r["passed"] for n, r in rows.items() if n != "compile"), {n: r["why"] for n, r in rows.items()}
    compile_ = rows["compile"]
    assert re.fullmatch(r"ran past its limit of 4 s: stopped with the [1-9]\d* process\(es\) it had started",
                        compile_["why"]), compile_
    real = rows["ddp-minimal"]  # ran for real, on the CPU: make ddp-minimal, not make -n
    assert real["passed"] and real["command"].startswith("make --no-print-directory ddp-minimal"), real
    assert "--device cuda" not in rows["compile"]["command"] and "--max-steps 3" in rows["compile"]["command"]
    assert rows["ddp-spawn"]["command"].startswith("make -n ") and rows["ddp-spawn"]["final"] == {}
    assert "--collect-only" in rows["suite"]["command"] and "-n" not in rows["suite"]["command"].split()
    assert record_problems(record) == []
    m = record["machine"]
    assert m["rehearsal"] == {"gpus": 1, "cores": CORES} and m["gpus"] == 0 and m["executable"] == PYTHON
    import torch

    assert (m["torch"], m["torch_cuda"]) == (torch.__version__, torch.version.cuda)
    # side by side: every stream started while the suite's stream (collecting the tests for seconds) ran; the
    # figures came before them all
    started = {n: r["started"] for n, r in rows.items()}
    suite = rows["suite"]
    assert all(started[st[0].name] < suite["started"] + suite["seconds"] for st in plan.streams[1:]), rows
    assert all(started[f.name] < min(started[st[0].name] for st in plan.streams) for f in plan.figures)
    md = (out / f"{name}.md").read_text()
    assert "FAILED: compile" in md and all(f"| {n} |" in md for n in rows)
    with tarfile.open(out / f"{name}_logs.tar.gz") as tar:
        assert tar.getnames() == [f"{name}_logs/compile.log"]
        log = tar.extractfile(tar.getnames()[0]).read().decode()
    assert log.startswith("$ make --no-print-directory compile") and compile_["why"] in log
    assert sorted(p.name for p in (REPO / "bench/results").iterdir()) == before, "nothing recorded"


def record_problems(record: dict) -> list[str]:
    """What is wrong with a gpu_check JSON: the machine named, every step with its verdict, the figures and goals."""
    problems = []
    machine = record.get("machine", {})
    for key in ("gpu", "gpus", "driver", "torch", "torch_cuda", "executable", "python", "cores"):
        if key not in machine:
            problems.append(f"machine lacks {key}")
    steps = record.get("steps", [])
    if not steps:
        problems.append("no steps")
    for row in steps:
        if not {"step", "passed", "why", "seconds", "timeout", "command", "final"} <= set(row):
            problems.append(f"step row {row.get('step')} is incomplete")
        elif not row["passed"] and not row.get("skipped") and not row["why"]:
            problems.append(f"{row['step']} failed without saying why")
    failed = sorted(r["step"] for r in steps if not r.get("passed") and not r.get("skipped"))
    if sorted(record.get("failed", [])) != failed:
        problems.append(f"failed lists {record.get('failed')}, the steps say {failed}")
    if set(record.get("goals", {})) != set(gpu_check.goals({})):
        problems.append("goals missing")
    if not isinstance(record.get("figures"), dict) or not isinstance(record.get("benchmarks"), dict):
        problems.append("figures or benchmarks missing")
    return problems


def test_every_recorded_gpu_check_is_well_formed():
    """docs/gpu-check.md: a GPU run copied into bench/results is checked for its form (the checker itself is held to
    a made-up record here, and to a real rehearsal's record in the test above)."""
    for path in sorted((REPO / "bench/results").glob("gpu_check_*.json")):
        assert record_problems(json.loads(path.read_text())) == [], path.name
    good = {"machine": {k: "x" for k in ("gpu", "gpus", "driver", "torch", "torch_cuda", "executable", "python",
                                         "cores")},
            "steps": [{"step": "a", "passed": False, "why": "exit code 1", "seconds": 1, "timeout": 9, "command": "c",
                       "final": {}}], "failed": ["a"], "goals": gpu_check.goals({}), "figures": {}, "benchmarks": {}}
    assert record_problems(good) == []
    assert record_problems({**good, "failed": []}) == ["failed lists [], the steps say ['a']"]
    assert record_problems({**good, "steps": [{**good["steps"][0], "why": None}]})[0] == "a failed without saying why"


SLEEPER = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
           "'import os, sys, time; os.setsid(); open(sys.argv[1], \"w\").write(f\"{{os.getpid()}} {{os.getsid(0)}}\"); "
           "time.sleep(60)', {pidfile!r}]); time.sleep({parent})")


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def tagged(tag: str) -> list[int]:
    """Read here, not with gpu_check's own function: the processes whose environment holds the step's tag."""
    marker, found = f"{gpu_check.TAG}={tag}".encode(), []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "environ").read_bytes().split(b"\0"):
                found += [int(entry.name)] if alive(int(entry.name)) else []
        except OSError:
            pass
    return found


def wait_for(path: Path, seconds: float) -> str:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if path.exists() and path.read_text():
            return path.read_text()
        time.sleep(0.05)
    return ""


@pytest.mark.waits
@pytest.mark.parametrize("parent", [60, 0])
def test_a_step_past_its_limit_or_leaving_processes_behind_ends_all_it_started(parent, tmp_path):
    """A step starts a child that starts a grandchild in a session of its own (as torchrun's workers are):
    stopping the step's process group would miss it. Past the limit (the parent sleeps 60 s, the limit is 3 s),
    or left behind by a step that ended (the parent exits at once), every tagged process is stopped."""
    pidfile = tmp_path / "grandchild"
    step = gpu_check.Step("sleeper", [PYTHON, "-c", SLEEPER.format(pidfile=str(pidfile), parent=parent)],
                          timeout=3)
    tag = uuid.uuid4().hex
    start = time.time()
    row = gpu_check.run_step(step, tag=tag, linger=2.0)
    pid, sid = map(int, wait_for(pidfile, 1).split())
    assert sid == pid, "the grandchild had a session of its own"
    assert not row["passed"] and time.time() - start < 20, row
    if parent:
        assert row["why"].startswith("ran past its limit of 3 s: stopped with the 2 process(es)"), row
    else:
        assert row["why"] == "left 1 process(es) running after it ended (stopped)", row
    assert row["why"] in row["log"]
    assert not alive(pid) and tagged(tag) == []


@pytest.mark.waits
def test_stopping_gpu_check_stops_every_stream_and_still_writes_the_report(tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM, which gpu-check turns into it) while two streams run: both steps are stopped with what
    they started, the report says so, and gpu-check ends with 130."""
    pidfiles = [tmp_path / f"grandchild{i}" for i in range(2)]
    streams = [[gpu_check.Step(f"sleeper{i}", [PYTHON, "-c", SLEEPER.format(pidfile=str(p), parent=60)],
                               timeout=120)] for i, p in enumerate(pidfiles)]
    report = gpu_check.Report(tmp_path / "out", "gpu_check_test", "# test", {"torch": "", "torch_cuda": None,
                              "driver": None, "python": "", "executable": "", "cores": 2, "date": ""}, 1,
                              tmp_path / "scratch", [("Streams", ["sleeper0", "sleeper1"])], {})
    timer = threading.Timer(1.0, lambda: [wait_for(p, 10) for p in pidfiles] and _thread.interrupt_main())
    # interrupt_main() acts as a Ctrl-C only where Python handles SIGINT: a suite started in the background by a
    # shell without job control (`cmd &` in a script) inherits SIGINT ignored, and then nothing would arrive
    ignored = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        timer.start()
        code = gpu_check.run_one_command(gpu_check.OneCommand([], streams), report, lambda s: s, None)
        timer.join()
    finally:
        signal.signal(signal.SIGINT, ignored)
    pids = [int(wait_for(p, 1).split()[0]) for p in pidfiles]
    assert code == 130 and not any(alive(pid) for pid in pids), pids
    record = json.loads((tmp_path / "out/gpu_check_test.json").read_text())
    assert {r["step"] for r in record["steps"]} == {"sleeper0", "sleeper1", "(gpu-check)"}, record["steps"]
    assert all(not r["passed"] for r in record["steps"])
