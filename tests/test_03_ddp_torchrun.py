"""Section 03: torchrun. Every test launches real torchrun jobs with short timeouts."""

import os
import re
import subprocess

import pytest
import torch

import common
import harness
from harness import PYTHON, REPO, TAG, TEST_IMAGES, TORCHRUN, check_trace, drive, kill_tagged, make, run, traced
from tools import course

STANDIN = "--dataset mnist-standin --data-dir {}"


@pytest.mark.slow
def test_headline_torchrun_run(data_dir, tmp_path):
    # 60 of each epoch's 188 steps per rank (the whole two epochs, to 97 %, are the spawn headline's test)
    res = make("ddp-torchrun", "NPROC=2", "ARGS=--max-steps 60 " + STANDIN.format(data_dir),
               env=traced(tmp_path / "trace"), timeout=240)
    final = res.final
    assert final["world_size"] == 2 and final["test_samples"] == TEST_IMAGES
    # the preflight prints the plain command it runs, as make prints the commands it starts
    assert re.search(r"^\S*python\S* -m torch\.distributed\.run --standalone --local-addr 127\.0\.0\.1 "
                     r"--nproc-per-node 2 03_ddp_torchrun/mnist_torchrun\.py --max-steps 60 ", res.stdout, re.M), \
        res.tail()
    check_trace(tmp_path / "trace", world_size=2, epochs=2)  # disjoint shards, new orders, equal replicas, ...
    assert final["test_acc"] >= 0.9, res.tail()
    # the lines the README shows: who runs where, one line per epoch, the final line
    device, backend = common.device_and_backend(procs_per_node=2)
    assert f"\n2 processes, 2 on this node, on {device.type} with {backend}\n" in res.stdout, res.tail()
    for epoch in (1, 2):
        assert re.search(rf"^epoch {epoch}/2: train_loss=\S+ test_loss=\S+ test_acc=\S+$", res.stdout, re.M), res.tail()
    assert final["epochs"] == 2 and final["dataset"] == "mnist-standin"


@pytest.mark.slow
@pytest.mark.ranks(3)
def test_three_processes_count_every_test_image_once(standin_dir, tmp_path):
    """On the stand-in as a user has it (4000 test images), as the README says. The claim is what the script counts:
    its 3 ranks are forked from one start of torch with torchrun's variables (harness.drive); the launch itself is
    the headline's test."""
    # --device cpu: the claim is about counting, and the check below compares the printed 4-decimal accuracy with
    # a CPU re-evaluation exactly. On 3+ GPUs the run would evaluate with cuDNN (TF32 convolutions by default),
    # where one argmax in 4,000 that flips against the CPU's turns an exact comparison red.
    (res,) = drive([{"script": "03_ddp_torchrun/mnist_torchrun.py", "nproc": 3, "folder": str(tmp_path / "trace"),
                     "args": ["--epochs", "1", "--device", "cpu", "--max-steps", "10", "--checkpoint-dir",
                              str(tmp_path / "ck"), *STANDIN.format(standin_dir).split()]}], tmp_path)
    assert res["codes"] == [0, 0, 0], res["output"][-3000:]
    final = res["final"]
    assert final["world_size"] == 3
    assert final["test_samples"] == 4000, "4000 is not divisible by 3: no sample may be counted twice"
    check_trace(tmp_path / "trace", world_size=3, epochs=1, checks=("shards", "eval", "eval_sum", "writer"))
    from tools import tracecheck

    savers = {rank for rank, events in tracecheck.load(tmp_path / "trace").items() for e in events if e["ev"] == "save"}
    assert savers == {0}, f"the checkpoint is written by global rank 0 alone, not by ranks {savers}"
    # the distributed accuracy equals a plain single-process evaluation of the saved checkpoint
    model = common.ConvNet()
    model.load_state_dict(torch.load(tmp_path / "ck" / "mnist_torchrun.pt", weights_only=True)["model"])
    test_set = common.load_dataset("mnist-standin", standin_dir, train=False)
    correct, samples, _ = common.evaluate(model, course.batch_loader(test_set, 1000), "cpu").tolist()
    assert samples == 4000 and round(correct / samples, 4) == final["test_acc"]


def elastic_run(data_dir, tmp_path, device):
    res = make("elastic-restart", "NPROC=2", f"ELASTIC={tmp_path}/elastic", "FAIL_AT=20",  # 2: bitwise on any machine
               f"ARGS=--epochs 2 --max-steps 15 --timeout 30 --device {device} " + STANDIN.format(data_dir)
               + (" --backend gloo" if device == "cuda" and common.usable_gpus() < 2 else ""), timeout=300)
    assert "RuntimeError: simulated failure of rank 1 at training batch 20" in res.output
    assert "resumed from" in res.stdout and "after epoch 1" in res.stdout  # the restarted group continued
    return res


def final_weights(elastic_dir) -> tuple[bool, float]:
    """The test's own comparison of the two checkpoints `make elastic-restart` wrote (the uninterrupted run's and
    the restarted one's), not compare_checkpoints.py's verdict: (every tensor bitwise equal, largest difference)."""
    first, second = (torch.load(elastic_dir / run / "mnist_torchrun.pt", map_location="cpu", weights_only=True)
                     for run in ("straight", "recovered"))
    assert first["epoch"] == second["epoch"] == 2, (first["epoch"], second["epoch"])  # both ran to the end
    a, b = first["model"], second["model"]
    assert a.keys() == b.keys() and len(a) > 0, sorted(a.keys() ^ b.keys())
    equal = all(torch.equal(a[k], b[k]) for k in a)
    return equal, max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.mark.slow
def test_elastic_restart_recovers_with_identical_weights(tmp_path, monkeypatch, capsys):
    """`make elastic-stress`'s one run with the workaround (bench/stress.py elastic, called here as that target calls
    it) is the restart demo: rank 1 fails at batch 20, the group resumes after epoch 1, and the final weights are
    bitwise equal. stress.py works in a temporary folder that it deletes; here that folder is under tmp_path, so
    that the test loads the two checkpoints and compares them itself."""
    import json

    from harness import stress_in_process

    code, out, work = stress_in_process(["elastic", "--runs", "1", "--nproc", "2", "--sides", "on", "--show",
                                         "--device", "cpu"], tmp_path, monkeypatch, capsys)
    assert code == 0, out[-4000:]
    assert "RuntimeError: simulated failure of rank 1 at training batch 20" in out, out[-4000:]
    assert "resumed from" in out and "after epoch 1" in out  # the restarted group continued
    equal, largest = final_weights(work / "elastic")
    assert equal and largest == 0.0, f"the restarted run's weights differ from the uninterrupted run's by {largest}"
    assert "bitwise identical: True" in out  # and compare_checkpoints.py, which the target runs, says the same
    record = json.loads(next(tmp_path.glob("stress_elastic_*.json")).read_text())
    assert (record["runs"], record["passed_with_workaround"], record["passed_without_workaround"]) == (1, 1, None)


@pytest.mark.slow
@pytest.mark.cuda
def test_elastic_restart_on_a_gpu(data_dir, tmp_path):
    """Trained on a GPU, the restarted run's weights equal the uninterrupted run's within compare_checkpoints.py's
    --gpu-atol (1e-5), bitwise where they are (2 ranks on a GPU often are); the test compares the checkpoints
    itself, and compare_checkpoints.py's printed verdict must agree with it."""
    res = elastic_run(data_dir, tmp_path, "cuda")
    equal, largest = final_weights(tmp_path / "elastic")
    assert equal or largest <= 1e-5, f"the restarted run's weights differ from the uninterrupted run's by {largest}"
    found = re.search(r"(bitwise identical|identical within (\S+) \(trained on a GPU\)): (\w+), "
                      r"largest difference (\S+)", res.stdout)
    assert found and found[3] == "True", res.tail()
    assert float(found[4]) == pytest.approx(largest, rel=1e-2, abs=1e-12), (found[4], largest)


@pytest.mark.slow
def test_without_restarts_a_failure_ends_the_job_promptly_with_the_traceback(data_dir, tmp_path):
    """One run for two claims: COURSE_FAIL_AT=1:mid fails rank 1 in the middle of the last epoch of a real run, and
    with --max-restarts 0 the job ends at once, its summary naming the rank with its own traceback."""
    # the group timeout is 300 s: the 90 s outer bound shows torchrun stops the others at once
    res = run([*TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
               REPO / "03_ddp_torchrun/mnist_torchrun.py", *STANDIN.format(data_dir).split(),
               "--epochs", "2", "--max-steps", "6", "--timeout", "300"],
              env={**traced(tmp_path / "trace"), "COURSE_FAIL_AT": "1:mid"}, timeout=90, expect_rc=1)
    summary = res.stderr[res.stderr.find("Root Cause"):]
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", summary), res.tail()
    # epoch 1 fetches 7 batches (the 7th ends the loop at --max-steps 6); the middle of epoch 2's 6 steps: 7 + 3 + 1
    failure = "simulated failure of rank 1 at training batch 11 (COURSE_FAIL_AT=1:mid)"
    assert failure in summary, "@record puts the real traceback there\n" + res.tail()


def test_fail_at_mid_falls_in_the_last_epoch_of_real_mnist_on_8_ranks(tmp_path):
    """make elastic-restart's default FAIL_AT=mid: on 8 processes real MNIST has 118 batches of 64 per rank and
    epoch, 236 in two epochs, so a fixed batch 250 never came and no restart happened."""
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    from tools import tracer

    per_epoch = len(DataLoader(range(60_000), batch_size=64, sampler=DistributedSampler(range(60_000), 8, 1)))
    assert per_epoch == 118
    chosen = [tracer.fail_batch("mid", 2, done=(p - 1) * per_epoch, this_pass=p, pass_batches=per_epoch)
              for p in (1, 2)]
    assert chosen[0] is None and per_epoch < chosen[1] <= 2 * per_epoch, chosen  # inside epoch 2
    assert chosen[1] == 178
    assert tracer.fail_batch("mid", None, 118, 2, 118) == 178  # a script without --epochs: epoch 2
    assert tracer.fail_batch("mid", 3, 118, 2, 118) is None  # 3 epochs: the middle of the third
    assert tracer.fail_batch("250", 2, 0, 1, 118) == 250  # a number is taken as it is
    # make on a machine whose nvidia-smi lists 8 GPUs (a fake one on PATH): NPROC 8, and the failure at mid
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nfor i in 0 1 2 3 4 5 6 7; do echo \"GPU $i: NVIDIA H100 (UUID: GPU-$i)\"; done\n")
    smi.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES" and k not in harness.OUTER_MAKE}
    dry = subprocess.run(["make", "-n", "--no-print-directory", "elastic-restart", "elastic-stress"], cwd=REPO,
                         capture_output=True, text=True, timeout=60,
                         env={**env, "PATH": f"{tmp_path}:{env['PATH']}"}).stdout
    assert "--nproc-per-node 8 " in dry and "COURSE_FAIL_AT=1:mid " in dry, dry
    assert "fails at the middle of the last epoch" in dry
    assert "bench/stress.py elastic --runs 10 --nproc 8 " in dry, dry  # make elastic-stress: RUNS=10 each way
    # the failure comes from the tracer, from outside: the script has no line for it
    script = (REPO / "03_ddp_torchrun/mnist_torchrun.py").read_text()
    assert "COURSE_FAIL_AT" not in script and "tracer" not in script


@pytest.mark.slow
def test_torchrun_by_hand_with_nccl_and_no_gpu_per_process_stops_in_one_line(data_dir):
    """No preflight by hand: the script's own device choice (common.device_and_backend) refuses, before any
    process group, what NCCL cannot do. CUDA hidden: the same on any machine."""
    res = run([*TORCHRUN, "--standalone", "--nproc-per-node", "1", "--max-restarts", "0",
               REPO / "03_ddp_torchrun/mnist_torchrun.py", *STANDIN.format(data_dir).split(), "--backend", "nccl"],
              env={"CUDA_VISIBLE_DEVICES": ""}, timeout=90, expect_rc=1)
    assert "RuntimeError: --backend nccl needs CUDA GPUs and none is usable here; use --backend gloo" in res.stderr, \
        res.tail()
    assert "init_process_group" not in res.stderr  # stopped before it


@pytest.mark.slow
def test_legacy_launcher_passes_local_rank_and_it_parses(data_dir):
    res = make("launch-legacy", "NPROC=1", "EPOCHS=1", "ARGS=--max-steps 3 " + STANDIN.format(data_dir), timeout=120)
    assert res.final["world_size"] == 1
    assert "torch.distributed.launch is deprecated" in res.stderr  # it still runs, and says so


@pytest.mark.slow
def test_the_blogs_init_check_launch_runs_the_courses_init_check():
    """The blog's `python -m torch.distributed.launch --nnodes 1 init_proc.py`, with init_check.py: the launcher passes
    `--local-rank=0`, which the script accepts (it reads LOCAL_RANK). PET_LOCAL_ADDR binds the agent to 127.0.0.1,
    as every test's torchrun is bound (a host name that does not resolve would stall it), leaving the command as the
    blog writes it."""
    res = run([PYTHON, "-m", "torch.distributed.launch", "--nnodes", "1", REPO / "03_ddp_torchrun/init_check.py"],
              env={"PET_LOCAL_ADDR": "127.0.0.1"}, timeout=120)
    assert "torch.distributed.launch is deprecated" in res.stderr, res.tail()
    assert "unrecognized arguments" not in res.stderr
    assert re.search(r"^\[pid \d+\] rank=0 local_rank=0 world_size=1 backend=", res.stdout, re.M), res.tail()
    assert "process group of 1 is OK: all_reduce of ones = 1" in res.stdout, res.tail()


EXPORTED = """
import os

import torch.distributed as dist

# no `if __name__ == "__main__":` guard: torchrun runs this file itself in every worker and pickles nothing
dist.init_process_group("gloo")
print(f"rank {dist.get_rank()}: num_epoch={os.environ.get('num_epoch')} MASTER_PORT={os.environ['MASTER_PORT']}\\n",
      end="", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_variable_exported_before_torchrun_reaches_every_worker(tmp_path):
    """The notes' `os.environ['num_epoch']`: exported in the shell that starts torchrun, a variable reaches every
    worker. Their `torchrun --nproc_per_node=2 script.py` (no --master-port) meets on a free port, not on 29500:
    a one-node torchrun without --master-port is a c10d rendezvous on localhost:0. And a torchrun script needs no
    __main__ guard."""
    script = tmp_path / "show_env.py"
    script.write_text(EXPORTED)
    torchrun = " ".join(str(part) for part in TORCHRUN)
    res = run(["bash", "-c", f"export num_epoch=3; {torchrun} --nproc_per_node=2 {script}"], timeout=120)
    seen = re.findall(r"^rank (\d): num_epoch=(\S+) MASTER_PORT=(\d+)$", res.stdout, re.M)
    assert sorted(rank for rank, _, _ in seen) == ["0", "1"], res.tail()  # each worker ran the file once
    assert {value for _, value, _ in seen} == {"3"}, seen
    ports = {port for _, _, port in seen}
    # torchrun tells an unset --master-port apart (its default None) where it turns one node into c10d on a free
    # port (2.14); where the default is 29500 itself (2.11) it meets there, statically
    from torch.distributed.run import get_args_parser

    free = get_args_parser().get_default("master_port") is None
    assert len(ports) == 1 and (ports != {"29500"}) == free, (seen, free)


def test_the_old_launchers_use_env_sets_local_rank_instead_of_passing_it(tmp_path):
    show = tmp_path / "show.py"  # a worker that needs no torch: what arrived, as argument and in the environment
    show.write_text("import os, sys\nprint('argv', sys.argv[1:], 'LOCAL_RANK', os.environ.get('LOCAL_RANK'))\n")
    res = run([PYTHON, "-m", "torch.distributed.launch", "--use-env", "--local-addr", "127.0.0.1",
               "--nproc-per-node", "1", show], timeout=120)
    assert "argv [] LOCAL_RANK 0" in res.stdout, res.tail()
    # the reference writes it --use-env=True: a flag without a value, so argparse refuses the value
    refused = run([PYTHON, "-m", "torch.distributed.launch", "--use-env=True", "--nproc-per-node", "1", show],
                  timeout=120, expect_rc=2)
    assert "argument --use-env/--use_env: ignored explicit argument 'True'" in refused.stderr, refused.tail()


def scripts() -> dict[str, str]:
    """Every script of the numbered sections, by its path: its source."""
    return {str(p.relative_to(REPO)): p.read_text() for p in sorted(REPO.glob("0[1-7]_*/*.py"))}


def test_the_training_code_is_the_spawn_steps_but_for_the_checkpoints_name():
    """README: against `make ddp-spawn`, train() is the same function; only how the processes start changed."""
    import ast

    def train(path):
        source = (REPO / path).read_text()
        return next(ast.get_source_segment(source, node) for node in ast.parse(source).body
                    if isinstance(node, ast.FunctionDef) and node.name == "train")

    spawn, torchrun = train("02_ddp_spawn/mnist_spawn.py"), train("03_ddp_torchrun/mnist_torchrun.py")
    assert spawn != torchrun and spawn.replace('"mnist_spawn.pt"', '"mnist_torchrun.pt"') == torchrun


def test_no_script_starts_a_thread_so_every_process_group_is_made_in_the_main_thread():
    """README: process groups are created from one thread, "as every script here does"."""
    threaded = [path for path, source in scripts().items()
                if re.search(r"^\s*(import threading|from threading |import concurrent|from concurrent)", source, re.M)]
    assert not threaded, threaded
    assert any("init_process_group(" in source for source in scripts().values())


def test_the_torchrun_scripts_that_accept_the_old_launchers_local_rank():
    """README: mnist_torchrun.py, init_check.py and the later torchrun scripts accept and ignore --local-rank in
    both spellings; the other small torchrun demos take none."""
    torchrun = {path: source for path, source in scripts().items() if 'os.environ["LOCAL_RANK"]' in source}
    accepting = {path for path, source in torchrun.items() if '"--local-rank", "--local_rank", type=int, help='
                 '"passed by the deprecated launcher; unused")' in source}
    assert accepting == {"03_ddp_torchrun/mnist_torchrun.py", "03_ddp_torchrun/init_check.py",
                         "06_amp_syncbn/mnist_amp_syncbn.py",
                         "06_amp_syncbn/cifar_resnet.py", "07_beyond_ddp/mnist_fsdp2.py",
                         "07_beyond_ddp/mnist_zero_compile.py"}, accepting
    others = [path for path in torchrun if path not in accepting]
    assert {"03_ddp_torchrun/elastic_ddp.py", "06_amp_syncbn/syncbn_by_hand.py"} <= set(others), others
    assert any(path.startswith("05_collectives/") for path in others), others
    assert not [path for path in others if "local-rank" in torchrun[path] or "local_rank\"" in torchrun[path]]


def test_the_readme_cites_the_newest_elastic_stress_record_taken_with_the_current_fix():
    """README: the restart demo's rates with and without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 are the newest
    record's, and that record was taken with this fix (older ones with the earlier per-attempt store namespace)."""
    import json

    records = sorted((REPO / "bench/results").glob("stress_elastic_*.json"))  # dated names: the newest last
    assert records, "no elastic stress record"
    newest = json.loads(records[-1].read_text())
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in newest["meaning"], records[-1]
    runs, fixed, unfixed = newest["runs"], newest["passed_with_workaround"], newest["passed_without_workaround"]
    text = " ".join((REPO / "03_ddp_torchrun/README.md").read_text().split())
    assert (f"with the fix {fixed} of {runs} runs recovered; without it, {unfixed} of {runs}, the other "
            f"{runs - unfixed} ending") in text


def test_init_device_mesh_starts_the_default_group_itself_with_gloo_for_the_cpu():
    code = ("import torch.distributed as dist\nfrom torch.distributed.device_mesh import init_device_mesh\n"
            "assert not dist.is_initialized()\nmesh = init_device_mesh('cpu', (1,))\n"
            "print('group', dist.is_initialized(), dist.get_world_size(), mesh.size(), dist.get_backend(),"
            " dist.get_backend_config())\n"
            "dist.destroy_process_group()\n")
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(common.free_port())}
    # no backend named: the CPU gets Gloo, which get_backend() does not say ("undefined"); the config does (with
    # nccl for cuda where torch has CUDA: the mesh asks for both devices' backends)
    out = harness.in_fork(code, env=env, timeout=120).stdout
    assert "group True 1 1 undefined " in out and "cpu:gloo" in out.split()[-1].split(","), out


def test_old_underscore_spelling_parses_without_launcher(data_dir, monkeypatch):
    """`--local_rank 0`, as the old launcher passed it, is one of the script's own argparse spellings."""
    import argparse
    import sys

    from tools import preflight

    monkeypatch.setattr(argparse.ArgumentParser, "error", argparse.ArgumentParser.error)  # the parse sets these:
    monkeypatch.setattr(sys, "argv", sys.argv)  # monkeypatch puts them back afterwards
    monkeypatch.setattr(sys, "path", list(sys.path))
    _, args = preflight.parse_script_args(REPO / "03_ddp_torchrun/mnist_torchrun.py",
                                       ["--local_rank", "0", *STANDIN.format(data_dir).split()])
    assert args.local_rank == 0 and args.dataset == "mnist-standin"


@pytest.mark.slow
def test_the_references_exported_variables_start_two_processes_by_hand(data_dir):
    """The reference's way: export MASTER_ADDR, MASTER_PORT and WORLD_SIZE, then start the script once per rank by
    hand. That is mnist_tcp.py's lesson (no launcher); with env:// it meets at the exported address."""
    port = common.free_port()
    script = (f"{PYTHON} 04_multinode_tcp/mnist_tcp.py --init-method env:// --world-size 2 --rank $RANK "
              f"{STANDIN.format(data_dir)} --epochs 1 --max-steps 3")
    res = run(["bash", "-c", f"unset LOCAL_RANK LOCAL_WORLD_SIZE; export MASTER_ADDR=127.0.0.1 MASTER_PORT={port} "
               f"WORLD_SIZE=2 OMP_NUM_THREADS=1; export RANK=1; {script} & export RANK=0; {script}; wait"],
              timeout=120)
    assert res.final["world_size"] == 2 and res.final["test_samples"] == TEST_IMAGES, res.tail()


def test_running_without_torchrun_names_the_missing_variable():
    """By hand, the script answers with Python's own words: torchrun's variables are missing."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    res = run([PYTHON, REPO / "03_ddp_torchrun/mnist_torchrun.py"], env=env, expect_rc=1)
    assert "KeyError: 'RANK'" in res.stderr


def front_door() -> tuple[str, str, list[str]]:
    """README.md's "DDP in one screen": the program, the command the README runs it with, the lines it shows."""
    readme = (REPO / "README.md").read_text()
    screen = readme.partition("## DDP in one screen\n")[2].partition("\n## ")[0]
    blocks = re.findall(r"^```(\w*)\n(.*?)^```$", screen, re.M | re.S)
    assert [kind for kind, _ in blocks] == ["python", ""], blocks  # the program, then what it printed
    (command,) = re.findall(r"run `(torchrun [^`]+)`", screen)
    return blocks[0][1], command, blocks[1][1].splitlines()


def test_the_front_doors_program_is_elastic_ddp_whole_and_imports_nothing_of_the_course():
    """README.md shows 03_ddp_torchrun/elastic_ddp.py whole, byte for byte, and it imports only PyTorch and the
    standard library: a program a newcomer can paste."""
    import ast
    import sys

    program, command, _ = front_door()
    assert program == (REPO / "03_ddp_torchrun/elastic_ddp.py").read_text()
    assert len(program.splitlines()) <= 70  # the smallest complete program stays small
    imported = {alias.name.split(".")[0] for node in ast.walk(ast.parse(program))
                if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in
                ([ast.alias(node.module)] if isinstance(node, ast.ImportFrom) else node.names)}
    assert imported - set(sys.stdlib_module_names) == {"torch"}, imported


@pytest.mark.slow
@pytest.mark.ranks(4)  # two jobs of 2 workers each
def test_the_front_doors_program_runs_as_the_readme_says_beside_another_standalone_job(bare, tmp_path):
    """The README's program, saved as the README says, started with the README's command by an interpreter that
    holds torch and not the course, in a folder of its own: it prints the README's lines (the first epoch's loss
    depends on the random start) and learns y = 3x - 1. PET_LOCAL_ADDR binds torchrun to 127.0.0.1, as every test's
    torchrun is, leaving the command as the README writes it. An init check started at the same moment with
    `torchrun --standalone` as well succeeds too: each picks a free port, and neither leaves a process behind."""
    program, command, shown = front_door()
    words = command.split()
    assert words[0] == "torchrun" and words[-1] == "elastic_ddp.py" and "--standalone" in words, command
    (tmp_path / "elastic_ddp.py").write_text(program)
    jobs = [([*TORCHRUN, "--standalone", "--nproc-per-node", "2", REPO / "03_ddp_torchrun/init_check.py"], REPO,
             {"TQDM_DISABLE": "1"}, subprocess.STDOUT),
            ([bare, "-m", "torch.distributed.run", *words[1:]], tmp_path,
             {**harness.BARE_ENV, "PET_LOCAL_ADDR": "127.0.0.1"}, subprocess.PIPE)]
    tags = [f"collide-{os.getpid()}-{i}" for i in range(2)]
    procs = []
    for (cmd, cwd, env, stderr), tag in zip(jobs, tags, strict=True):
        env = {k: v for k, v in {**os.environ, **env, TAG: tag}.items() if v is not None}
        procs.append(subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=stderr,
                                      text=True, start_new_session=True))
    try:
        outputs = [p.communicate(timeout=120) for p in procs]
        left = [pid for tag in tags for pid in harness.wait_gone(tag, 10)]
    finally:
        for tag in tags:
            kill_tagged(tag)
    assert not left, f"processes left behind after both jobs ended: {left}"
    for p, (out, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, (out, err)
    init = outputs[0][0]
    backend = common.device_and_backend(procs_per_node=2)[1]  # nccl on a machine with 2 GPUs
    assert "process group of 2 is OK: all_reduce of ones = 2" in init
    assert len(re.findall(rf"\[pid \d+\] rank=\d local_rank=\d world_size=2 backend={backend}", init)) == 2
    printed = outputs[1][0].splitlines()
    assert len(printed) == len(shown), (printed, shown)
    for got, want in zip(printed, shown, strict=True):
        epoch = re.fullmatch(r"epoch (\d): loss=(\d\.\d{5})", want)
        if epoch:  # the loss after epoch 1 depends on the random start; later ones are 0 to 5 decimals
            seen = re.fullmatch(rf"epoch {epoch[1]}: loss=(\d\.\d{{5}})", got)
            assert seen and (epoch[1] == "1" or seen[1] == epoch[2]), (got, want)
        else:
            assert got == want, (got, want)
