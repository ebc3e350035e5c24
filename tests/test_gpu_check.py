"""make gpu-check: what runs where, in which part, within which time limits; and its rehearsal on this CPU machine
for a pretended GPU count (dry runs of every step, one short step for real, a step that runs out of time)."""

import json
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import common
from harness import PYTHON, REPO, run
from tools import course

sys.path.insert(0, str(REPO / "bench"))
import gpu_check  # noqa: E402

NOT_RUN_BY_GPU_CHECK = {"help", "setup", "data", "test", "test-fast", "notebooks", "diffs", "mutants", "lint", "clean",
                        "distclean", "check-nproc", "check-nnodes", "bench", "bench-quick", "gpu-check",
                        "bench-versions",  # CPU only: two versions of the course against each other
                        "compat",  # CPU only: the course on another torch release, from the package index
                        "doctor",  # a check-up of the user's own script, which names it
                        "existing-python"}  # the setup step of PY=python3
ONE_COMMAND_S = 600  # what a borrowed GPU machine gives one command


def make_targets() -> set[str]:
    makefile = (REPO / "Makefile").read_text().replace("\\\n", " ")
    return set(" ".join(re.findall(r"^\.PHONY:(.*)$", makefile, re.M)).split())


@pytest.mark.parametrize("gpus", [0, 1, 2, 8])
def test_gpu_check_plans_every_target_for_the_gpus_present(gpus, monkeypatch):
    from gpu_check import plan

    steps = plan(gpus, is_root=False)
    if gpus == 0:
        assert steps == []
        return
    by_target = {}
    for step in steps:
        if step.cmd[0] == "make":
            by_target.setdefault(step.cmd[2], []).append(step)
    assert set(by_target) == make_targets() - NOT_RUN_BY_GPU_CHECK, "every example target runs once"
    pytests = [s for s in steps if s.group == "tests"]
    assert steps[0] is pytests[0] and all("cuda or multigpu" in s.cmd for s in pytests)
    files = [a for s in pytests for a in s.cmd if a.startswith("tests/")]
    marked = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py")
                    if re.search(r"@pytest\.mark\.(cuda|multigpu)\b", p.read_text()))
    assert sorted(files) == marked, "every test file with GPU tests, each in one part"

    def var(target, name):
        return next((a.split("=", 1)[1] for a in by_target[target][0].cmd if a.startswith(name + "=")), None)

    if gpus == 1:  # several processes share the one GPU through Gloo; what needs 2 GPUs says so
        assert var("ddp-torchrun", "NPROC") == "2" and var("ddp-torchrun", "ARGS") == "--device cuda --backend gloo"
        assert by_target["bench-allreduce"][0].skip == "not run: needs 2 GPUs"
        assert "needs 2 GPUs" in by_target["collectives"][0].note
    else:  # one process per GPU with NCCL
        assert var("ddp-torchrun", "NPROC") == str(gpus) and var("ddp-torchrun", "ARGS") is None
        assert var("bench-allreduce", "NPROC") == str(gpus) and not by_target["bench-allreduce"][0].skip
        assert var("multinode-tcp", "NPROC") == str(gpus // 2), "2 nodes x NPROC: one GPU per process"
    assert var("ddp-basics", "NPROC") == (str(gpus // 2) if gpus >= 4 else ("2" if gpus == 1 else str(gpus)))
    # every ddp-basics step that runs the model-parallel demo asks for a placement this machine can give
    monkeypatch.syspath_prepend(str(REPO / "02_ddp_spawn"))
    import ddp_basics

    ALL_DEMOS = "basic checkpoint model-parallel process"  # noqa: N806 - the Makefile's default DEMOS
    demos = {tuple(dict(a.split("=", 1) for a in s.cmd[3:]).get("DEMOS", ALL_DEMOS).split()): s
             for s in by_target["ddp-basics"]}
    assert sorted(d for names in demos for d in names) == ["basic", "checkpoint", "model-parallel", "process"]
    step = next(s for names, s in demos.items() if "model-parallel" in names)
    found = dict(a.split("=", 1) for a in step.cmd[3:])
    flags = dict(zip(*[iter((found.get("ARGS") or "").split())] * 2, strict=True))
    monkeypatch.setattr(common, "usable_gpus", lambda: gpus)
    ddp_basics.model_parallel_placement(flags.get("--device", "auto"), flags.get("--backend"), int(found["NPROC"]))
    assert by_target["multinode-netns"][0].skip == "needs root allowed to create network namespaces"
    assert not plan(gpus, is_root=True)[[s.name for s in steps].index("multinode-netns")].skip


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_every_part_ends_within_one_borrowed_command(gpus, capsys):
    """The time limits of a part add up to at most PART_LIMIT_S, which leaves a minute of the 10 a borrowed GPU
    machine gives one command; every step is in exactly one part, in the plan's order; a step's limit is above
    the time it is expected to take."""
    steps = gpu_check.plan(gpus, is_root=True)
    parts = gpu_check.parts(steps)
    assert gpu_check.PART_LIMIT_S <= ONE_COMMAND_S - 60
    for name, part in parts.items():
        limits, typical = gpu_check.budget(part)
        assert 0 < limits <= gpu_check.PART_LIMIT_S, (name, limits)
        order = [steps.index(s) for s in part]
        assert order == sorted(order), name
    assert sorted((s for p in parts.values() for s in p), key=steps.index) == steps
    assert all(s.typical < s.timeout <= gpu_check.PART_LIMIT_S for s in steps)
    assert len({s.name for s in steps}) == len(steps), "a step is named by its name alone (--only, the results)"
    assert [n for n in parts if n.startswith("tests")] == (["tests"] if gpus == 1 else ["tests-1", "tests-2"])
    assert list(parts)[-1].startswith("bench") and any(n.startswith("targets-") for n in parts)
    # about 20 minutes on one GPU, 30 on eight: the expected times, not the limits
    total = sum(gpu_check.budget(p)[1] for p in parts.values())
    assert total <= (30 if gpus == 1 else 40) * 60, total
    gpu_check.show(parts, gpus)
    listed = capsys.readouterr().out
    for name, part in parts.items():
        assert re.search(rf"^{name}: {len(part)} step\(s\), time limits {gpu_check.budget(part)[0]:.0f} s",
                         listed, re.M), listed
    assert re.search(r"^elastic-restart\s+make --no-print-directory elastic-restart .*\(limit 150 s\)", listed, re.M)


def test_a_part_is_chosen_by_name_by_group_or_all():
    parts = gpu_check.parts(gpu_check.plan(8))
    assert gpu_check.select(parts, "targets-2") == ["targets-2"]
    assert gpu_check.select(parts, "tests") == ["tests-1", "tests-2"]
    assert gpu_check.select(parts, "bench-1,tests-2,bench-1") == ["bench-1", "tests-2"]
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
        dry = subprocess.run(["make", "-n", *step.cmd[1:]], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert dry.returncode == 0, (step.name, dry.stderr)
        assert "No rule to make target" not in dry.stderr, step.name


def test_the_output_patterns_it_reads_are_what_the_scripts_print():
    """Each step's pattern against a line as its script prints it, and that line's fixed words in the script."""
    final = "final: test_acc=0.9871 test_samples=10000 world_size=2 epochs=1 seconds=12.4 dataset=mnist-standin"
    printed = {"init-check": ("process group of 2 is OK: all_reduce of ones = 2", "03_ddp_torchrun/init_check.py",
                              ["process group of {world_size} is {'OK'"]),
               "elastic-restart": ("epochs 2 and 2: 8 tensors, bitwise identical: True, largest difference 0",
                                   "03_ddp_torchrun/compare_checkpoints.py",
                                   ["bitwise identical: {equal}", "identical within {args.gpu_atol:g} (trained on a "
                                    "GPU): {equal}"]),
               "pytest-1": ("7 passed, 4 skipped in 81.20s", None, []), "pytest-2": ("5 passed in 61.02s", None, [])}
    steps = {s.name: s for s in gpu_check.plan(2)}
    checked = 0
    for name, step in steps.items():
        if not step.expect:
            continue
        nproc = dict(a.split("=", 1) for a in step.cmd[3:] if "=" in a).get("NPROC", "2")
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
    training = {"01_dataparallel/mnist_single.py", "01_dataparallel/mnist_dataparallel.py",
                "02_ddp_spawn/mnist_spawn.py", "03_ddp_torchrun/mnist_torchrun.py", "04_multinode_tcp/mnist_tcp.py",
                "06_amp_syncbn/cifar_resnet.py", "06_amp_syncbn/mnist_amp_syncbn.py"}
    for script in training:
        assert 'print(f"final: test_acc=' in (REPO / script).read_text() and "world_size={world_size}" in \
            (REPO / script).read_text(), script


def test_results_go_to_runs_unless_recorded():
    assert gpu_check.output_dir(record=False) == REPO / "runs" / "gpu_check"
    assert gpu_check.output_dir(record=True) == REPO / "bench" / "results"
    for gpus in (1, 8):  # every step that writes files writes them where the results go
        commands = [" ".join(s.cmd) for s in gpu_check.plan(gpus)]
        assert not [c for c in commands if "bench/results" in c]
        writers = [c for c in commands if "BENCH_OUT=" in c or "--output-dir" in c]
        assert len(writers) >= 8 and all("runs/gpu_check" in c for c in writers), writers
    for record, flag in (("", False), ("RECORD=1", True)):
        dry = subprocess.run(["make", "-n", "gpu-check", "PART=tests", *filter(None, [record])], cwd=REPO,
                             capture_output=True, text=True, timeout=60).stdout
        assert "bench/gpu_check.py --part tests" in dry and ("--record" in dry) == flag, dry
    dry = subprocess.run(["make", "-n", "gpu-check"], cwd=REPO, capture_output=True, text=True, timeout=60).stdout
    assert "--part list" in dry, "without PART it lists the parts: nothing starts that could outrun the machine"


def test_gpu_check_figures_and_goals_come_from_the_runs(tmp_path):
    from gpu_check import figures, goals

    (tmp_path / "amp_h100_2026-11-22.json").write_text(json.dumps({
        "results": {f"resnet18/{p}": {"median": v} for p, v in (("fp32", 1000.0), ("tf32", 2500.0),
                                                                 ("bf16", 4000.0), ("fp16", 4200.0))},
        "ratios": {f"resnet18/{p}_vs_fp32": {"median": r} for p, r in (("tf32", 2.5), ("bf16", 4.0))}}))
    (tmp_path / "throughput_nccl_h100_2026-11-22.json").write_text(json.dumps({
        "ratios": {"ddp_ws1_overhead": {"median": 0.05}, "dataparallel_vs_plain": {"median": 0.97}}}))
    rows = [{"step": "smoke", "passed": True, "final": {"dataset": "mnist", "epochs": "2",
                                                        "test_acc": "0.9851", "seconds": "3.0"}},
            {"step": "bench-allreduce", "passed": False, "skipped": "not run: needs 2 GPUs", "final": {}}]
    fig = figures(rows, tmp_path, since=0, gpus=1)
    assert fig["mnist_one_gpu"] == {"dataset": "mnist", "epochs": 2, "test_acc": 0.9851, "seconds_per_epoch": 1.5}
    assert fig["resnet18_images_per_s"]["bf16"] == 4000.0 and fig["resnet18_vs_fp32"]["bf16"] == 4.0
    assert fig["ddp_ws1_overhead"] == 0.05 and fig["all_reduce_busbw_GBps"] == "not run: needs 2 GPUs"
    assert "all_reduce_busbw_GBps" not in figures(rows[:1], tmp_path, since=0, gpus=1), "a part without the sweep"
    assert goals(fig) == {"mnist_test_acc >= 0.98": True, "mnist_epoch_s < 2": True, "resnet18 bf16 >= 2x fp32": True}
    rows[0]["final"]["dataset"] = "mnist-standin"  # no MNIST on the machine: its figures are shown, not judged
    standin = figures(rows, tmp_path, since=0, gpus=1)
    assert standin["mnist_one_gpu"]["dataset"] == "mnist-standin"
    assert goals(standin)["mnist_test_acc >= 0.98"] is None and goals(standin)["mnist_epoch_s < 2"] is None
    assert set(goals({}).values()) == {None}, "a goal that was not measured is not called met"


def test_gpu_check_says_so_on_a_machine_without_gpus():
    res = run([PYTHON, REPO / "bench/gpu_check.py", "--part", "all"], env={"CUDA_VISIBLE_DEVICES": ""}, expect_rc=2)
    assert "gpu-check needs a CUDA GPU" in res.stderr and "--rehearse --gpus 1" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.slow
def test_the_rehearsal_runs_the_whole_plan_for_one_gpu_and_one_step_for_real(data_dir, tmp_path):
    """Every step of every part for 1 GPU: make -n, pytest --collect-only, and ddp-torchrun for real on the CPU
    (3 steps). One result file per part, with the machine; the real step's `final:` line parsed."""
    out = tmp_path / "out"
    before = sorted(p.name for p in (REPO / "bench/results").iterdir())
    venv = (REPO / ".venv/bin/python").resolve()
    py = [] if Path(PYTHON).resolve() == venv else ["--py", PYTHON]  # make test PY=...: every make uses it too
    res = run([PYTHON, REPO / "bench/gpu_check.py", "--rehearse", "--gpus", "1", "--part", "all", *py,
               "--real", "ddp-torchrun", "--real-args", f"--max-steps 3 --dataset mnist-standin --data-dir {data_dir}",
               "--output-dir", out], timeout=240)
    parts = gpu_check.parts(gpu_check.plan(1, is_root=True))  # cut the same on any machine
    where = f"rehearse1gpu_cpu{gpu_check.benchlib.usable_cores()}_{time.strftime('%Y-%m-%d')}"
    records = {}
    for name in parts:
        path = out / f"gpu_check_{name}_{where}.json"
        assert path.exists() and path.with_suffix(".md").exists(), (path, res.tail())
        records[name] = json.loads(path.read_text())
    import torch

    for name, record in records.items():
        m = record["machine"]
        assert record["part"] == name and m["rehearsal"] == {"gpus": 1} and m["gpus"] == 0
        assert (m["torch"], m["torch_cuda"], m["executable"]) == (torch.__version__, torch.version.cuda, PYTHON)
        assert m["python"] == ".".join(map(str, sys.version_info[:3])) and "driver" in m and "gpu" in m
        assert [r["step"] for r in record["steps"]] == [s.name for s in parts[name]]
        for row in record["steps"]:
            assert row["passed"] or row.get("skipped"), (name, row)
    rows = {r["step"]: r for record in records.values() for r in record["steps"]}
    real = rows["ddp-torchrun"]
    assert real["final"]["world_size"] == "2" and real["final"]["dataset"] == "mnist-standin", real
    assert "--max-steps 3" in real["command"] and "--device cuda" not in real["command"]
    assert rows["ddp-spawn"]["command"].startswith("make -n ") and rows["ddp-spawn"]["final"] == {}
    assert "--collect-only" in rows["pytest-1"]["command"]
    assert f"BENCH_OUT={out}" in rows["bench-amp"]["command"], "the benchmarks write where the results go"
    assert sorted(p.name for p in (REPO / "bench/results").iterdir()) == before, "nothing recorded"


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
    row = gpu_check.run_step(step, tmp_path / "logs", tag=tag, linger=2.0)
    pid, sid = map(int, wait_for(pidfile, 1).split())
    assert sid == pid, "the grandchild had a session of its own"
    assert not row["passed"] and time.time() - start < 20, row
    if parent:
        assert row["why"].startswith("ran past its limit of 3 s: stopped with the 2 process(es)"), row
    else:
        assert row["why"] == "left 1 process(es) running after it ended (stopped)", row
    assert Path(row["log"]).exists() and row["why"] in Path(row["log"]).read_text()
    assert not alive(pid) and tagged(tag) == []
