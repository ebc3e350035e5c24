"""Section 02: DDP started with mp.spawn. Every multi-process test really launches the processes."""

import ast
import importlib.util
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

import common
from harness import BARE_ENV, PYTHON, REPO, TEST_IMAGES, TORCHRUN, check_trace, drive, make, python, run, traced

# ------------------------------------------------------------------ DistributedSampler, in-process


def test_distributed_sampler_covers_pads_and_reshuffles_only_with_set_epoch():
    data = list(range(10))
    shards = [list(DistributedSampler(data, num_replicas=3, rank=r, shuffle=False)) for r in range(3)]
    assert shards == [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]]  # padded to 12 by repeating the start
    assert sorted(set(sum(shards, []))) == data
    dropped = [list(DistributedSampler(data, num_replicas=3, rank=r, shuffle=False, drop_last=True))
               for r in range(3)]
    assert sum(len(s) for s in dropped) == 9 and 9 not in sum(dropped, [])

    sampler = DistributedSampler(list(range(100)), num_replicas=2, rank=0, shuffle=True, seed=0)
    first, again = list(sampler), list(sampler)
    assert first == again, "without set_epoch every epoch repeats the same order"
    sampler.set_epoch(1)
    assert list(sampler) != first
    other = DistributedSampler(list(range(100)), num_replicas=2, rank=1, shuffle=True, seed=0)
    other.set_epoch(1)
    assert not set(other) & set(sampler), "ranks draw disjoint samples from one shared permutation"


# ------------------------------------------------------------------ the toy demos


def reference_weights(world_size: int, batchnorm: bool, per_slice: bool, per_rank=32, steps=5, lr=0.1):
    """One process trains what ddp_equivalence.py's docstring describes, on the whole global batch: its initial
    weights from seed 0, the batch from a generator seeded 1, plain SGD; the loss is one MSE over the whole batch,
    or (per_slice) the mean of each rank's slice's MSE, which runs BatchNorm on each slice apart."""
    from torch import nn

    torch.manual_seed(0)
    model = (nn.Sequential(nn.Linear(10, 10), nn.BatchNorm1d(10), nn.ReLU(), nn.Linear(10, 5)) if batchnorm
             else common.ToyModel())
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(world_size * per_rank, 10, generator=g), torch.randn(world_size * per_rank, 5, generator=g)
    slices = [slice(r * per_rank, (r + 1) * per_rank) for r in range(world_size)] if per_slice else [slice(None)]
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        optimizer.zero_grad()
        (sum(nn.functional.mse_loss(model(x[s]), y[s]) for s in slices) / len(slices)).backward()
        optimizer.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [3])  # 3: every claim of the script at a world size other than 2
@pytest.mark.ranks(3)
def test_ddp_averages_gradients(nproc):
    """Each rank's printed weights (the first and last three), judged against one process trained here."""
    res = make("ddp-equivalence", f"NPROC={nproc}", timeout=120)
    printed = {}
    for rank, model, values in re.findall(r"^rank (\d+): (ToyModel|with BatchNorm) weights, first and last 3: (.+)$",
                                          res.stdout, re.M):
        printed.setdefault(model, {})[int(rank)] = torch.tensor([float(v) for v in values.split()])
    assert {m: sorted(r) for m, r in printed.items()} == {"ToyModel": [0, 1, 2], "with BatchNorm": [0, 1, 2]}, \
        res.tail()
    for model, ranks in printed.items():  # DDP keeps the replicas equal: every rank printed the same numbers
        assert all(torch.equal(ranks[r], ranks[0]) for r in ranks), (model, ranks)

    def ends(weights):
        return torch.cat([weights[:3], weights[-3:]])

    plain, bn = printed["ToyModel"][0], printed["with BatchNorm"][0]
    # 8 decimals printed: 5e-9 of rounding; float32 sums in another order add a few 1e-8
    assert (plain - ends(reference_weights(nproc, False, False))).abs().max() < 1e-6, \
        "N ranks x b samples must train like 1 process x N*b samples"
    assert (bn - ends(reference_weights(nproc, True, True))).abs().max() < 1e-6, \
        "with BatchNorm, DDP equals one process that runs BatchNorm on each rank's slice"
    assert (bn - ends(reference_weights(nproc, True, False))).abs().max() > 1e-4, \
        "...and not one that normalises over the whole batch"
    # the script's own table, which the learner reads, agrees
    m = re.search(r"plain_diff=(\S+) bn_whole_diff=(\S+) bn_shard_diff=(\S+) gradients_averaged=True", res.stdout)
    assert m and float(m[1]) < 1e-5 and float(m[2]) > 1e-4 and float(m[3]) < 1e-5, res.tail()


@pytest.mark.slow
def test_make_ddp_basics_runs_all_four_demos(bare, tmp_path):
    # bare: an interpreter without the course installed, and make started from another folder (-C): mp.spawn's
    # children import common.py all the same
    out = make("-C", REPO, "ddp-basics", "NPROC=2", f"PY={bare}", env=BARE_ENV, cwd=tmp_path, timeout=180).stdout
    # the truth from each rank's own weight digests, not from the script's verdict lines
    digests = weight_digests(out)
    assert sorted(digests) == ["basic", "checkpoint", "model-parallel", "process"], out
    for demo, ranks in digests.items():
        assert sorted(ranks) == [0, 1], (demo, out)
        started = {stages["as loaded" if demo == "checkpoint" else "after DDP()"] for stages in ranks.values()}
        stepped = {stages["after one step"] for stages in ranks.values()}
        assert len(stepped) == 1, f"{demo}: the ranks hold different weights after the step: {ranks}"
        assert len(started) == 1 and started != stepped, f"{demo}: not one common start, or the step changed nothing"
        if demo in ("basic", "process"):  # each rank drew its own weights; DDP() made them rank 0's
            assert ranks[0]["at init"] != ranks[1]["at init"] and ranks[1]["after DDP()"] == ranks[0]["at init"], ranks
    # and the script's own verdicts, which the learner reads, agree with them
    assert "all 2 ranks hold the same weights: True" in out
    assert "after loading and one more step, all ranks hold the same weights: True" in out
    assert "rank 1 loaded the checkpoint (weights_only=True" in out
    assert "model parallel inside, data parallel across: ranks agree: True" in out
    assert "mp.Process: 2 processes started and joined, all exit codes 0" in out


def weight_digests(out: str) -> dict[str, dict[int, dict[str, str]]]:
    """ddp_basics.py's digest lines, per demo and rank: {"basic": {0: {"at init": "1f2e3d4c", ...}, 1: ...}}."""
    found = {}
    for section in re.split(r"^--- ddp_basics.py ", out, flags=re.M)[1:]:
        demo, _, text = section.partition("\n")
        lines = re.findall(r"^rank (\d+): weights digest (.+)$", text, re.M)  # "1f2e3d4c at init, ..."
        found[demo.strip()] = {int(rank): {stage: digest for digest, stage in re.findall(r"(\w{8}) ([^,]+)", rest)}
                               for rank, rest in lines}
    return found


@pytest.mark.slow
def test_a_failing_rank_stops_mp_spawn_promptly_with_its_error_visible():
    # rank 0 would wait 300 s for rank 1 at init; the outer 60 s bound shows mp.spawn stops it at once
    res = python("02_ddp_spawn/ddp_basics.py", "fail", "--timeout", "300", timeout=60, expect_rc=1)
    assert "Process 1 terminated with the following error" in res.stderr
    assert "rank 1 fails on purpose" in res.stderr


UNGUARDED = """
import torch.multiprocessing as mp

def worker(rank):
    print(f"worker {rank} ran", flush=True)

{launch}
"""


@pytest.mark.slow
def test_mp_spawn_needs_the_main_guard(tmp_path):
    """Spawned children re-import the main module; an unguarded mp.spawn would run again in each."""
    launch = "mp.spawn(worker, nprocs=1)"  # one child shows it: each child re-imports the main module
    (tmp_path / "unguarded.py").write_text(UNGUARDED.replace("{launch}", launch))
    (tmp_path / "guarded.py").write_text(UNGUARDED.replace("{launch}", 'if __name__ == "__main__":\n    ' + launch))
    bad = run([PYTHON, "unguarded.py"], cwd=tmp_path, timeout=60, expect_rc=1)
    assert "bootstrapping phase" in bad.stderr and "worker 0 ran" not in bad.stdout
    # what the notes quote is only the parent's report; the child's own error above is the cause
    assert re.search(r"ProcessExitedException: process \d terminated with exit code 1", bad.stderr), bad.stderr
    good = run([PYTHON, "guarded.py"], cwd=tmp_path, timeout=60)
    assert "worker 0 ran" in good.stdout


# ------------------------------------------------------------------ mnist_spawn


@pytest.mark.slow
def test_headline_spawn_run_reaches_97_percent_with_disjoint_shards_and_equal_weights(data_dir, tmp_path):
    res = make("ddp-spawn", "NPROC=2", f"ARGS=--dataset mnist-standin --data-dir {data_dir}",
               env=traced(tmp_path / "trace"), timeout=240)
    final = res.final
    assert final["world_size"] == 2 and final["test_samples"] == TEST_IMAGES and final["epochs"] == 2
    assert final["test_acc"] >= 0.97, res.tail()
    check_trace(tmp_path / "trace", world_size=2, epochs=2)  # disjoint shards, new orders, equal replicas, ...
    assert "leaked semaphore" not in res.stderr


def spawn_runs(folder, data_dir, nproc, device="cpu"):
    """mnist_spawn run from `folder`: 2 epochs straight (A), and 1 epoch + resume + 1 epoch (B).

    On the CPU by default, on any machine: the CPU is where the course claims bitwise-equal weights.
    """
    base = [PYTHON, "mnist_spawn.py", "--nproc", str(nproc), "--dataset", "mnist-standin", "--data-dir", data_dir,
            "--max-steps", "15", "--timeout", "60", "--device", device]
    if device == "cuda" and common.usable_gpus() < nproc:
        base += ["--backend", "gloo"]  # processes share the GPU(s)
    a_dir, b_dir = folder / f"A{nproc}{device}", folder / f"B{nproc}{device}"
    a = run(base + ["--epochs", "2", "--checkpoint-dir", a_dir], cwd=folder, timeout=180)
    b1 = run(base + ["--epochs", "1", "--checkpoint-dir", b_dir], cwd=folder, timeout=180)
    b2 = run(base + ["--epochs", "2", "--checkpoint-dir", b_dir], cwd=folder, timeout=180)  # continues by itself
    assert "resumed from" in b2.stdout and "after epoch 1" in b2.stdout
    straight = torch.load(a_dir / "mnist_spawn.pt", map_location="cpu", weights_only=True)
    resumed = torch.load(b_dir / "mnist_spawn.pt", map_location="cpu", weights_only=True)
    return a, b1, b2, straight, resumed


@pytest.fixture(scope="module")
def copied(tmp_path_factory):
    """A folder holding only mnist_spawn.py and what it imports: what a user copies into a project."""
    folder = tmp_path_factory.mktemp("copied")
    for name in ("02_ddp_spawn/mnist_spawn.py", "common.py"):
        shutil.copy(REPO / name, folder)
    return folder


@pytest.mark.slow
def test_two_ranks_resume_gives_bitwise_the_same_weights(data_dir, tmp_path):
    """2 epochs straight (A) against 1 epoch and a second run that continues from its checkpoint (B), 2 ranks on the
    CPU: the same weights and momentum, bit for bit. The claim is the script's arithmetic, so its runs share one
    start of torch (harness.drive forks mp.spawn's children); the headline test starts it as a user does."""
    base = ["--dataset", "mnist-standin", "--data-dir", str(data_dir), "--max-steps", "15", "--timeout", "60",
            "--device", "cpu"]
    a, b1, b2 = drive([{"script": "02_ddp_spawn/mnist_spawn.py", "how": "spawn", "folder": str(tmp_path / name),
                        "args": [*base, "--epochs", str(epochs), "--checkpoint-dir", str(tmp_path / folder)]}
                       for name, epochs, folder in (("A", 2, "A"), ("B1", 1, "B"), ("B2", 2, "B"))], tmp_path)
    assert [a["codes"], b1["codes"], b2["codes"]] == [[0]] * 3, (a["output"] + b2["output"])[-3000:]
    assert "resumed from" in b2["output"] and "after epoch 1" in b2["output"], b2["output"][-3000:]
    straight = torch.load(tmp_path / "A" / "mnist_spawn.pt", map_location="cpu", weights_only=True)
    resumed = torch.load(tmp_path / "B" / "mnist_spawn.pt", map_location="cpu", weights_only=True)
    assert straight["epoch"] == resumed["epoch"] == 2
    common.ConvNet().load_state_dict(straight["model"])  # model.module's keys: no "module." prefix
    for key, value in straight["model"].items():
        assert torch.equal(value, resumed["model"][key]), key
    momentum = [s["momentum_buffer"] for s in straight["optimizer"]["state"].values()]
    momentum_resumed = [s["momentum_buffer"] for s in resumed["optimizer"]["state"].values()]
    assert all(torch.equal(x, y) for x, y in zip(momentum, momentum_resumed, strict=True))
    assert b2["final"]["test_acc"] == a["final"]["test_acc"] and a["final"]["epochs"] == 2


def load_script(path: str):
    spec = importlib.util.spec_from_file_location(Path(path).stem, REPO / path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_mnist_spawn_gives_each_process_one_thread_unless_told_otherwise(monkeypatch):
    """mp.spawn sets no OMP_NUM_THREADS (torchrun does): mnist_spawn.py sets 1 before it spawns, unless it is set."""
    script = load_script("02_ddp_spawn/mnist_spawn.py")
    seen = []
    monkeypatch.setattr(script.mp, "spawn", lambda fn, args, nprocs: seen.append(os.environ["OMP_NUM_THREADS"]))
    monkeypatch.setattr(script.common, "prepare_data", lambda dataset, data_dir: dataset)
    monkeypatch.setattr(sys, "argv", ["mnist_spawn.py", "--dataset", "mnist-standin"])
    for name in ("MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS"):  # set by main(); put back after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    script.main()
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    script.main()
    assert seen == ["1", "3"]


def test_every_lesson_script_that_wraps_a_model_frees_it_before_leaving_the_group():
    """The pitfall "Let no DDP model outlive its process group": in every script of the numbered folders that wraps
    a model, the `finally:` that calls destroy_process_group() calls gc.collect() before it; and mnist_spawn's
    main_worker holds no model (train() builds it)."""
    checked = []
    for script in sorted(REPO.glob("0[1-7]_*/*.py")):
        lines = script.read_text().splitlines()
        if not any(re.search(r"\b(DDP|DistributedDataParallel|fully_shard)\(", line) for line in lines):
            continue
        teardowns = [lines[max(0, i - 6):i] for i, line in enumerate(lines)
                     if re.match(r"\s+(dist\.)?destroy_process_group\(\)", line)]
        if not teardowns:  # names DDP in its texts only (the error gallery runs error_cases.py)
            continue
        teardowns = [above[max(j for j, a in enumerate(above) if a.strip() == "finally:"):] for above in teardowns
                     if any(a.strip() == "finally:" for a in above)]
        assert teardowns and all(any("gc.collect()" in a for a in block) for block in teardowns), script.name
        checked.append(script.name)
    assert "mnist_spawn.py" in checked and len(checked) >= 10, checked
    tree = ast.parse((REPO / "02_ddp_spawn/mnist_spawn.py").read_text())
    worker = next(f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "main_worker")
    assert "model" not in {n.id for n in ast.walk(worker) if isinstance(n, ast.Name)}


def test_the_training_scripts_take_the_learning_rate_as_given():
    """--lr reaches the optimizer unchanged, whatever the number of processes: no script scales it."""
    scripts = [p for p in sorted(REPO.glob("0[1-7]_*/*.py")) if "add_training_flags(" in p.read_text()]
    assert len(scripts) >= 8, scripts
    for script in scripts:
        assert set(re.findall(r"\S*\bargs\.lr\b\S*", script.read_text())) == {"lr=args.lr,"}, script.name


def test_spawn_refuses_impossible_requests():
    gpus = common.usable_gpus()  # one process more than there are GPUs: NCCL cannot work, on any machine
    res = python("tools/preflight.py", "02_ddp_spawn/mnist_spawn.py", "--backend", "nccl", "--nproc", str(gpus + 1),
                 expect_rc=2)
    assert ("nccl needs CUDA" if gpus == 0 else "NCCL needs one GPU per process") in res.stderr
    assert "Traceback" not in res.stderr
    res = make("ddp-spawn", "NPROC=0", expect_rc=2)
    assert "NPROC must be a whole number" in res.stderr


@pytest.mark.slow
@pytest.mark.cuda
def test_resume_on_a_gpu(copied, data_dir):
    """The GPU resume path: the checkpoint's RNG states come back to the CPU, the weights to the GPU.

    Two processes, on two GPUs with NCCL or sharing one through Gloo. cuDNN is made deterministic
    (common.seed_everything); the check allows float noise of 1e-5 from NCCL's or cuDNN's summation order.
    """
    a, _, b2, straight, resumed = spawn_runs(copied, data_dir, nproc=2, device="cuda")
    assert "resumed from" in b2.stdout
    for key, value in straight["model"].items():
        assert torch.allclose(value.double(), resumed["model"][key].double(), rtol=0, atol=1e-5), key


def timeline_module():
    import importlib.util

    # ddp_timeline.py's numbers and pictures: the overlap figures and the lane it adds to each trace
    spec = importlib.util.spec_from_file_location("timeline_report", REPO / "02_ddp_spawn/timeline_report.py")
    timeline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(timeline)
    return timeline


def test_timeline_lane_is_placed_by_the_host_side_step_mark_not_the_gpu_copy(tmp_path):
    """On CUDA the profiler writes each record_function range twice: on the host (user_annotation) and on the
    GPU's lane (gpu_user_annotation, another pid and clock). The added lane follows the host one, whichever comes
    last in the file."""
    timeline = timeline_module()
    cpu = {"ph": "X", "cat": "user_annotation", "name": "timeline step 0", "pid": 4242, "tid": 4242, "ts": 1000.0,
           "dur": 50.0}
    gpu = {**cpu, "cat": "gpu_user_annotation", "pid": 0, "tid": 7, "ts": 9000.0}
    trace = tmp_path / "trace.json"
    for events in ([cpu, gpu], [gpu, cpu]):
        trace.write_text(json.dumps({"traceEvents": events}))
        steps = [{"phases": [("forward", 10.0, 10.00001)], "buckets": [(0, 10.000002, 10.000004, 64)]}]
        timeline.add_lane(trace, steps, marks=[10.0])
        added = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("tid") == timeline.LANE]
        assert added and {e["pid"] for e in added} == {4242}, added
        forward = next(e for e in added if e["name"] == "forward (step 0)")
        assert forward["ts"] == pytest.approx(1000.0) and forward["dur"] == pytest.approx(10.0)
        bucket = next(e for e in added if e.get("cat") == "allreduce")
        assert bucket["ts"] == pytest.approx(1002.0)
    assert timeline.step_marks([gpu]) == {}


def test_timeline_on_cuda_reports_step_times_and_not_the_queued_all_reduce_times():
    timeline = timeline_module()
    # one rank, one step: forward 0-1, backward 1-4 (compute until 3), optimizer 4-5; a bucket 2-3.5
    every = [[{"phases": [("forward", 0.0, 1.0), ("backward", 1.0, 4.0, 3.0), ("optimizer", 4.0, 5.0)],
               "buckets": [(0, 2.0, 3.5, 1024)]}]]
    on_cpu = timeline.medians(every, "cpu")
    assert (on_cpu["step_s"], on_cpu["allreduce_s"], on_cpu["hidden_share"]) == (5.0, 1.5, 1.0 / 1.5)
    on_cuda = timeline.medians(every, "cuda")
    assert on_cuda["step_s"] == 5.0 and on_cuda["buckets"] == 1  # the step ends with a synchronize: measured
    assert all(on_cuda[k] is None for k in timeline.HOST_ONLY), on_cuda
    assert "not measured on CUDA" in timeline.describe(every, "cuda")
    assert "hidden under backward" in timeline.describe(every, "cpu")


@pytest.mark.slow
def test_timeline_all_reduce_overlaps_backward_only_with_several_buckets(tmp_path):
    # ResNet-18 has ~45 MB of gradients: several buckets by default, one with bucket_cap_mb=10000
    # one warm-up step: DDP has built its buckets in the order of the first backward by the second step
    # --device cpu: the overlap is measured on the host, which sees when CPU work ran; on CUDA it sees only when
    # work was queued, and the script reports no overlap there (the cuda test below)
    # the claim is what the script measures: its ranks are forked from one start of torch (harness.drive)
    (res,) = drive([{"script": "02_ddp_spawn/ddp_timeline.py", "how": "spawn", "folder": str(tmp_path / "run"),
                     "args": ["--device", "cpu", "--models", "resnet18", "--steps", "2", "--warmup", "1",
                              "--batch-size", "4", "--output-dir", str(tmp_path)]}], tmp_path)
    assert res["codes"] == [0], res["output"][-3000:]
    out = res["output"]
    for rank in (0, 1):
        seen = {}
        for variant in ("default", "one-bucket", "no-sync"):
            trace = json.loads((tmp_path / "traces" / f"resnet18_{variant}_rank{rank}.json").read_text())
            events = trace["traceEvents"]
            assert any(e.get("name", "").startswith("autograd::engine::evaluate_function") for e in events), \
                "not a torch.profiler trace"
            assert any(e.get("ph") == "M" and e.get("args", {}).get("name", "").startswith("DDP timeline")
                       for e in events), "the trace has no lane named DDP timeline"
            ours = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("compute", "allreduce")
                    and "(step " in e.get("name", "")]
            steps = {}
            for e in ours:
                steps.setdefault(e["name"].rsplit("(step ", 1)[1], []).append(e)
            assert len(steps) == 2, sorted(steps)
            for step in steps.values():
                computes = sorted((e for e in step if e["name"].startswith("backward compute")), key=lambda e: e["ts"])
                backwards = sorted((e for e in step if e["name"].startswith("backward (")), key=lambda e: e["ts"])
                buckets = [e for e in step if e["cat"] == "allreduce"]
                compute_end = computes[-1]["ts"] + computes[-1]["dur"]
                first = min(e["ts"] for e in buckets)
                seen.setdefault(variant, []).append((len(buckets), first < compute_end))
                if variant == "no-sync":  # 4 micro-batches; nothing all-reduced before the last backward
                    assert len(backwards) == 4
                    assert first >= backwards[-1]["ts"]
                # the all-reduce of the backward is waited for inside it
                assert max(e["ts"] + e["dur"] for e in buckets) <= backwards[-1]["ts"] + backwards[-1]["dur"] + 1
        assert all(n >= 2 and early for n, early in seen["default"]), seen  # starts while backward computes
        assert all(n == 1 and not early for n, early in seen["one-bucket"]), seen  # only after the last gradient
    summary = json.loads((tmp_path / "timeline.json").read_text())["results"]
    assert summary["resnet18/default"]["hidden_share"] > 0
    assert summary["resnet18/one-bucket"]["hidden_share"] == 0
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "timeline_resnet18.png").stat().st_size > 10_000
    else:  # one line says why there is no picture, and nothing else is missing
        why = "no plot timeline_resnet18.png: matplotlib is not installed here (the numbers are in timeline.json)"
        assert out.splitlines().count(why) == 1 and not (tmp_path / "timeline_resnet18.png").exists(), out
    assert re.search(r"resnet18 +default +step", out), out


@pytest.mark.slow
@pytest.mark.multigpu
def test_timeline_on_gpus_reports_step_times_and_places_its_lane_on_the_host(tmp_path):
    out = make("ddp-timeline", "NPROC=2", f"ARGS=--device cuda --models convnet --steps 2 --warmup 1 "
               f"--output-dir {tmp_path}", timeout=240).stdout
    summary = json.loads((tmp_path / "timeline.json").read_text())
    assert summary["config"]["device"] == "cuda" and summary["config"]["backend"] == "nccl"
    for result in summary["results"].values():
        assert result["step_s"] > 0 and result["hidden_share"] is None and result["allreduce_s"] is None
    assert "not measured on CUDA" in out
    timeline = timeline_module()
    for rank in (0, 1):
        events = json.loads((tmp_path / "traces" / f"convnet_default_rank{rank}.json").read_text())["traceEvents"]
        host = timeline.step_marks(events)["timeline step 0"]  # the profiler's GPU-side copy has the GPU's pid
        lane = [e for e in events if e.get("tid") == timeline.LANE and e.get("ph") == "X"]
        assert lane and {e["pid"] for e in lane} == {host["pid"]}
        first = min(e["ts"] for e in lane if e["name"].endswith("(step 0)"))
        assert host["ts"] - 1_000 <= first <= host["ts"] + host["dur"]  # within the host's step 0, microseconds


BUFFERS_AND_THE_BLOG = """
import datetime, torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
rank = dist.get_rank()
model = DDP(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
norm, x = model.module[1], torch.randn(8, 4)
def forward(stage, train=False):
    norm.running_mean.fill_(rank + 1.0)  # each rank its own statistics; rank 0's are 1.0
    model.train(train)
    with torch.set_grad_enabled(train):
        out = model(x)
    if train:
        out.sum().backward()
    else:
        print(f"rank {rank} {stage}: {norm.running_mean[0].item():g}\\n", end="", flush=True)  # one write
forward("first forward, before any training")
forward("second no_grad forward")
forward("training forward", train=True)
forward("first no_grad forward after training")
forward("second no_grad forward after training")
# the blog's loop, on a model of its own, in the same group
broadcasts, evaluating = {"evaluation": 0, "training": 0}, False
coalesced = dist._broadcast_coalesced  # what DDP calls to broadcast its buffers: counted here
def counted(*args, **kwargs):
    broadcasts["evaluation" if evaluating else "training"] += 1
    return coalesced(*args, **kwargs)
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(10, 10), nn.BatchNorm1d(10), nn.Linear(10, 1)))
dist._broadcast_coalesced = counted
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
def evaluate():  # the blog's evaluate(): rank 0 alone, through the DDP model, a few test batches
    global evaluating
    evaluating = True
    model.eval()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(8, 10))
    evaluating = False
for epoch in range(21):
    if epoch % 10 == 0 and rank == 0:  # the blog's schedule: at the start of every 10th epoch
        evaluate()
        print("rank 0 evaluated at the start of epoch", epoch, flush=True)
    model.train()
    for _ in range(3):
        loss = model(torch.randn(8, 10)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
weights = torch.cat([p.detach().flatten() for p in model.parameters()]).double().sum().item().hex()
print(f"rank {rank} finished training, weights {weights}, buffer broadcasts: {broadcasts}\\n", end="", flush=True)
dist.barrier()
if rank == 0:  # not the blog's: one more evaluation, after the last epoch
    evaluate()
    print("rank 0 evaluated after the last epoch", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_ddp_forwards_broadcast_the_buffers_and_the_blogs_rank_0_evaluation_pairs_with_the_next_training(tmp_path):
    """02's "Exact evaluation": DDP's first forward broadcasts rank 0's buffers, a no_grad one too, before any
    training step; a no_grad forward after a no_grad forward does not; the first after a training forward does.
    Then, in the same group, the blog's loop: rank 0 evaluates through the DDP model at the start of every 10th
    epoch, and the loop runs to its end: rank 0's evaluation broadcasts the buffers, which pairs with the other rank's
    next training forward, and rank 0's own next training forward skips its broadcast (each rank counts the buffer
    broadcasts DDP makes). One more evaluation after the last epoch has no partner: it fails."""
    script = tmp_path / "buffers_and_the_blog.py"
    script.write_text(BUFFERS_AND_THE_BLOG)
    res = run([*TORCHRUN, "--standalone", "--nproc-per-node", "2", script], timeout=120, expect_rc=1)
    assert re.findall(r"^rank 0 evaluated at the start of epoch (\d+)$", res.stdout, re.M) == ["0", "10", "20"], \
        res.tail()
    finished = re.findall(r"^rank (\d) finished training, weights (\S+), buffer broadcasts: (.+)$", res.stdout, re.M)
    counts = {int(r): ast.literal_eval(c) for r, _, c in finished}
    assert sorted(counts) == [0, 1], res.tail()  # both ranks ran the blog's loop to its end
    assert len({w for _, w, _ in finished}) == 1, finished  # with equal weights: the replicas stayed in step
    assert counts[0]["evaluation"] == 3 and counts[1]["evaluation"] == 0, counts
    # as many broadcasts on each rank: rank 0's three in evaluation took the place of three in training
    assert sum(counts[0].values()) == sum(counts[1].values()) == counts[1]["training"], counts
    assert counts[0]["training"] == counts[1]["training"] - 3, counts
    assert "rank 0 evaluated after the last epoch" not in res.stdout, res.tail()
    seen = {(int(r), stage): float(v) for r, stage, v in
            re.findall(r"^rank (\d) ((?:first|second|training) [^:]*): (\S+)$", res.stdout, re.M)}
    rank_1 = [seen[(1, stage)] for stage in ("first forward, before any training", "second no_grad forward",
                                             "first no_grad forward after training",
                                             "second no_grad forward after training")]
    assert rank_1 == [1.0, 2.0, 1.0, 2.0], seen  # 1.0: rank 0's statistics arrived; 2.0: rank 1 kept its own
    assert {v for (r, _), v in seen.items() if r == 0} == {1.0}, seen


_CYCLE = """
import gc, os, weakref, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d", rank=0, world_size=1)
def build():
    model = DDP(torch.nn.Linear(4, 4))
    model(torch.randn(2, 4)).sum().backward()
    return weakref.ref(model)
gc.disable()
for i in range(2):
    ref = build()
    print(i, ref() is not None)
    gc.collect()
    print(i, ref() is not None)
dist.destroy_process_group()
"""


def test_the_first_ddp_model_of_a_process_outlives_its_function_until_the_garbage_collector_runs():
    """02's pitfall: the first DDP model sits in a reference cycle (alive after its function returned, gone after
    gc.collect()); the second is freed at once. Why every script calls gc.collect() before destroy_process_group."""
    import common

    res = run([PYTHON, "-c", _CYCLE % common.free_port()], timeout=60)
    assert res.stdout.split() == ["0", "True", "0", "False", "1", "False", "1", "False"], res.tail()


def test_the_model_parallel_demo_wraps_its_two_device_model_without_device_ids():
    """DDP's rule for a module on several devices (or the CPU): device_ids=None; the single-device demos pass theirs."""
    tree = ast.parse((REPO / "02_ddp_spawn/ddp_basics.py").read_text())
    wraps = {f.name: [c for c in ast.walk(f) if isinstance(c, ast.Call) and getattr(c.func, "id", "") == "DDP"]
             for f in tree.body if isinstance(f, ast.FunctionDef) and f.name.startswith("demo_")}
    assert [k.arg for c in wraps.pop("demo_model_parallel") for k in c.keywords] == []
    assert wraps and all(any(k.arg == "device_ids" for k in c.keywords) for calls in wraps.values() for c in calls)
