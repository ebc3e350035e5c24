"""The usual mistakes and interruptions, as a new user makes them: nothing is lost, every mistake is one line,
and nothing hangs or lingers."""

import os
import re
import shutil
import signal
import subprocess
import time

import pytest
import torch

import common
import harness
from harness import DEAD_PROXY, REPO, TAG, TORCHRUN, exits, kill_tagged, make, run, wait_gone

STANDIN = "--dataset mnist-standin --data-dir {}"


def one_line(stderr: str) -> str:
    """The user's view of a refused command: exactly one line of ours (make adds its own `***` line)."""
    lines = [ln for ln in stderr.strip().splitlines() if not re.match(r"make(\[\d+\])?: \*\*\*", ln)]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def test_a_mistake_under_torchrun_is_one_line_said_once():
    """make checks the arguments in one process before torchrun starts NPROC of them (tools/preflight.py)."""
    res = make("ddp-torchrun", "NPROC=2", "EPOCHS=-1", expect_rc=2, timeout=60)
    assert "--epochs must be at least 1, got -1" in one_line(res.stderr) and res.stdout.count("error") == 0
    # the other mistakes, as make hands them to the preflight (BACKEND= is --backend, DATASET= --dataset),
    # checked in one interpreter
    cases = [(["--backend", "foo"], "argument --backend: invalid choice: 'foo'"),
             (["--dataset", "foo"], "argument --dataset: invalid choice: 'foo'"),
             (["--lr", "nan"], "--lr must be a positive number, got nan"),
             (["--checkpoint-dir", "/proc/no/such"], "--checkpoint-dir /proc/no/such cannot be created"),
             (["--data-dir", "/proc/no/such"], "--data-dir /proc/no/such cannot be created")]
    answers = exits([("tools/preflight.py", ["--nproc", "2", "03_ddp_torchrun/mnist_torchrun.py", *argv])
                     for argv, _ in cases])
    for (argv, words), (code, out, err) in zip(cases, answers, strict=True):
        last = err.strip().splitlines()[-1]  # in-process, @record's fault-handler warning may come first
        assert code == 2 and words in last and "Traceback" not in err and "error" not in out, (argv, err)


def test_nccl_without_enough_gpus_is_one_line():
    gpus = common.usable_gpus()
    res = make("ddp-torchrun", f"NPROC={gpus + 1}", "BACKEND=nccl", expect_rc=2, timeout=60)
    assert ("nccl needs CUDA GPUs" if gpus == 0 else "NCCL needs one GPU per process") in one_line(res.stderr)


def test_real_data_offline_is_one_line(tmp_path):
    res = make("ddp-torchrun", "NPROC=2", "DATASET=mnist", f"ARGS=--data-dir {tmp_path / 'empty'}",
               env=DEAD_PROXY, expect_rc=2, timeout=120)
    assert "--dataset mnist: not found" in one_line(res.stderr) and "mnist-standin" in res.stderr


def test_a_checkpoint_that_is_not_this_scripts_is_one_line_and_left_as_it_is(tmp_path):
    """make's preflight loads a checkpoint the run would continue; a damaged or foreign one is refused."""
    foreign = tmp_path / "mnist_torchrun.pt"
    torch.save({"weights": torch.zeros(3)}, foreign)
    before = foreign.read_bytes()
    res = make("ddp-torchrun", "NPROC=2", f"ARGS=--checkpoint-dir {tmp_path}", expect_rc=2, timeout=60)
    assert f"{foreign} is not a checkpoint of mnist_torchrun.py" in one_line(res.stderr)
    assert foreign.read_bytes() == before, "a refused checkpoint is left as it is"
    # a bf16 run's checkpoint (its GradScaler state is empty) continued with fp16: GradScaler would refuse it
    bf16 = tmp_path / "mnist_amp_syncbn.pt"
    torch.save({"model": {}, "optimizer": {}, "epoch": 1, "scaler": {}}, bf16)
    (code, _, err), = exits([("tools/preflight.py", ["06_amp_syncbn/mnist_amp_syncbn.py", "--amp", "fp16",
                                                     "--checkpoint-dir", str(tmp_path)])])
    assert code == 2 and f"{bf16} was saved by a run without fp16" in err.strip().splitlines()[-1], err
    foreign.write_bytes(b"PK\x03\x04 not really")
    res = make("ddp-torchrun", "NPROC=2", f"ARGS=--checkpoint-dir {tmp_path}", expect_rc=2, timeout=60)
    assert f"{foreign} is damaged or not a checkpoint" in one_line(res.stderr)


@pytest.mark.slow
def test_an_existing_checkpoint_is_continued_never_overwritten(data_dir, tmp_path):
    """A script started again with the same --checkpoint-dir: 2 epochs, then a "fresh" run of 1 (nothing left to
    train: the file stays as it is), then one of 3 (continues at epoch 3). The three starts share one start of torch
    (harness.drive); the claim is the script's."""
    args = [*STANDIN.format(data_dir).split(), "--max-steps", "5", "--checkpoint-dir", str(tmp_path / "ck")]
    saved = tmp_path / "ck" / "mnist_single.pt"
    setup = """
_save = torch.save
def save(obj, f, *a, **k):  # every save the scripts make is said in their output
    print("saving", os.path.basename(str(f)), flush=True)
    return _save(obj, f, *a, **k)
torch.save = save
"""
    first, again, longer = harness.drive(
        [{"script": "01_dataparallel/mnist_single.py", "nproc": 1, "folder": str(tmp_path / name),
          "args": [*args, "--epochs", str(epochs)]} for name, epochs in (("first", 2), ("again", 1), ("longer", 3))],
        tmp_path, setup=setup)
    assert [first["codes"], again["codes"], longer["codes"]] == [[0]] * 3, longer["output"][-3000:]
    assert first["final"]["epochs"] == 2
    assert f"resumed from {saved} after epoch 2" in again["output"] and "final:" not in again["output"]
    assert "saving" in first["output"] and "saving" not in again["output"], "a fresh run must not replace it"
    assert f"resumed from {saved} after epoch 2" in longer["output"]
    assert longer["final"]["epochs"] == 3 and torch.load(saved, weights_only=True)["epoch"] == 3


@pytest.mark.parametrize("procs, refused", [(100000, True), (3, False)])
def test_nproc_is_checked_against_memory_and_cores(procs, refused):
    res = make("check-nproc", f"NPROC={procs}", expect_rc=2 if refused else 0)
    if refused:
        assert "processes need about 100000 GB of memory" in one_line(res.stderr)
    else:
        cores = len(os.sched_getaffinity(0))
        assert ("WARNING: 3 processes on" in res.stdout) == (3 > cores and common.usable_gpus() == 0)


def start_tagged(cmd, tag, wait_for: str, timeout: float = 60) -> subprocess.Popen:
    """Start `cmd` in its own session, tagged, and return once `wait_for` appeared in its output."""
    proc = subprocess.Popen([str(c) for c in cmd], cwd=REPO, env={**os.environ, TAG: tag, "TQDM_DISABLE": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline, seen = time.time() + timeout, ""
    while time.time() < deadline:
        line = proc.stdout.readline()
        seen += line
        if wait_for in line:
            return proc
        if not line and proc.poll() is not None:
            break
    kill_tagged(tag)
    raise AssertionError(f"never saw {wait_for!r}:\n{seen[-3000:]}")


@pytest.mark.slow
def test_killing_make_stops_the_launcher_and_every_rank(data_dir):
    tag = f"kill-make-{os.getpid()}"
    proc = start_tagged(["make", "--no-print-directory", "multinode-tcp", "NNODES=2", "NPROC=1",
                         "ARGS=--epochs 5 " + STANDIN.format(data_dir)], tag, "joined via tcp")
    proc.send_signal(signal.SIGKILL)  # make alone: its children are not told
    proc.wait(timeout=10)
    assert wait_gone(tag, 10) == [], "the launcher script and the ranks must notice and stop"


@pytest.mark.slow
def test_stopping_torchrun_with_sigterm_stops_its_workers(data_dir):
    """Ctrl-C or SIGTERM to torchrun: its agent stops the workers (SIGKILL would leave them running: README)."""
    tag = f"kill-torchrun-{os.getpid()}"
    proc = start_tagged([*TORCHRUN, "--standalone", "--nproc-per-node", "2", REPO / "03_ddp_torchrun/mnist_torchrun.py",
                         "--epochs", "5", *STANDIN.format(data_dir).split()], tag, "2 on this node")
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert wait_gone(tag, 10) == []


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare")
                    or subprocess.run(["unshare", "--uts", "true"], capture_output=True).returncode != 0,
                    reason="needs root allowed to unshare(1) a host name of this test's own")
def test_single_node_targets_do_not_need_a_resolvable_host_name(data_dir):
    """A laptop whose host name is in no DNS and not in /etc/hosts: torchrun --standalone alone would wait in its
    rendezvous for minutes (past this test's outer bound); the make targets pass --local-addr 127.0.0.1, and the run
    trains and ends."""
    res = run(["unshare", "--uts", "sh", "-c", "hostname no-such-host-x7q2.invalid && exec make --no-print-directory "
               f"ddp-torchrun NPROC=2 EPOCHS=1 'ARGS=--max-steps 5 {STANDIN.format(data_dir)}'"], timeout=240)
    assert res.final["world_size"] == 2 and res.final["epochs"] == 1, res.tail()


def test_the_make_targets_the_local_launchers_and_the_tests_bind_torchrun_to_127_0_0_1():
    """The host-name trap above, without root: every torchrun or launch command of the Makefile, the local
    multi-node launcher and the tests' own torchrun pass --local-addr 127.0.0.1."""
    makefile = (REPO / "Makefile").read_text()
    commands = [line for line in re.findall(r"^.*-m torch\.distributed\.(?:run|launch)\b.*$", makefile, re.M)
                if "## " not in line]  # not a target's help text
    commands += re.findall(r"^.*-m torch\.distributed\.run\b.*$",
                           (REPO / "04_multinode_tcp/launch_torchrun_nodes.sh").read_text(), re.M)
    assert len(commands) >= 5 and all("--local-addr 127.0.0.1" in line for line in commands), commands
    assert TORCHRUN[-2:] == ["--local-addr", "127.0.0.1"]
