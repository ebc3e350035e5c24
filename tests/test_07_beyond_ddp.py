"""Section 07: FSDP2, ZeRO, torch.compile with DDP, uneven inputs with Join.

Two launches prove most of it: a driver forked with torch imported forks the ranks of each run (harness.drive:
tools/mutants.run gives them torchrun's variables), so a dozen runs cost about what three torchrun jobs would. The
driver also watches every run with the course's tracer, and can make rank 0 die at one point of its checkpoint's
save (a fault injected from outside: the script is unchanged).
"""

import argparse
import ast
import json
import math
import re

import pytest
import torch

import common
import harness
from harness import PYTHON, REPO, exits, run

# on the CPU also on a GPU machine: there --bf16 auto would train FSDP2 in bf16, which DDP's fp32 weights do not match
STANDIN = ["--dataset", "mnist-standin", "--timeout", "30", "--epochs", "2", "--max-steps", "4", "--device", "cpu"]
# the faults the driver (harness.drive) injects: CRASH names the point of mnist_fsdp2.py's save where rank 0 dies,
# as killed, in one run (a fault from outside: the script is unchanged)
_FAULTS = r"""
import torch.distributed.checkpoint, torch.distributed.fsdp  # once in the driver, not in every fork
from torch.distributed.checkpoint import filesystem

CRASH = None


def crash(point):
    if CRASH == point and os.environ.get("RANK") == "0":
        os._exit(9)


def finish(self, *args, _finish=filesystem._FileSystemWriter.finish, **kwargs):
    crash("shards")  # every rank's shards are written, .metadata is not
    return _finish(self, *args, **kwargs)


def save(obj, f, *args, _save=torch.save, **kwargs):
    if str(f).endswith("model.pt"):
        crash("weights")  # the shards and .metadata are written, the full weights are not
    return _save(obj, f, *args, **kwargs)


def replace(src, dst, *args, _replace=os.replace, **kwargs):
    _replace(src, dst, *args, **kwargs)
    crash("between" if str(dst).endswith(".old") else "after" if str(src).endswith(".tmp") else None)


filesystem._FileSystemWriter.finish, torch.save, os.replace = finish, save, replace
"""


def drive(runs: list, tmp_path) -> list[dict]:
    return harness.drive(runs, tmp_path, setup=_FAULTS)


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_close(a: dict, b: dict, what: str):
    assert a.keys() == b.keys(), what
    for key in a:
        assert torch.allclose(a[key].double(), b[key].double(), rtol=1e-4, atol=1e-6), \
            f"{what}: {key} differs by {(a[key].double() - b[key].double()).abs().max():.3g}"


def chunks(folder) -> dict:
    """From a sharded checkpoint's .metadata: each parameter's shards, as (rows, file that holds them)."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(folder)).read_metadata()
    files = {(index.fqn, tuple(index.offset)): info.relative_path for index, info in meta.storage_data.items()
             if index.offset is not None}
    return {key: [(c.sizes[0], files[(key, tuple(c.offsets))]) for c in m.chunks]
            for key, m in meta.state_dict_metadata.items()
            if key.startswith("model.") and key.endswith(("weight", "bias"))}


@pytest.mark.slow
@pytest.mark.ranks(3)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.load here, in one process, no group
def test_fsdp2_zero_and_compile_train_as_ddp_and_the_sharded_checkpoint_resumes_at_3(data_dir, tmp_path):
    """Same seed, same data, 2 ranks, 2 x 4 steps: FSDP2, ZeRO and compiled DDP (aot_eager: no C++ build in the test)
    end with DDP's weights, to rounding. FSDP2's sharded checkpoint holds 1/N of every parameter per rank's file,
    reads back exactly at another world size, and a run at 3 ranks continues its loss curve (in bf16: --bf16 on).
    FSDP2's evaluation runs as many batches on every rank where a fixed batch size would not.
    Uneven inputs: without Join the job ends by its 2 s timeout, naming the ranks; with Join it finishes."""
    from tools import data, standins, tracecheck

    odd = tmp_path / "odd-data"  # 6,001 test images: parts of 3,001 and 3,000 at 2 ranks, 2,001 and 2,000 at 3
    standins.write_mnist_standin(odd / data.STANDIN_SUBDIR, sizes=(1200, 6001))
    args = ["--data-dir", str(data_dir)]
    ck = tmp_path / "ck"

    def step(script, name, *extra, nproc=2):
        return {"script": script, "nproc": nproc, "args": [*STANDIN, *args, "--checkpoint-dir", str(ck / name), *extra],
                "folder": str(tmp_path / name), "listing": str(ck / name)}

    def odd_run(nproc):
        return {"script": "07_beyond_ddp/mnist_fsdp2.py", "nproc": nproc, "folder": str(tmp_path / f"odd{nproc}"),
                "args": [*STANDIN, "--data-dir", str(odd), "--epochs", "1", "--max-steps", "1"]}

    runs = [step("03_ddp_torchrun/mnist_torchrun.py", "ddp"),
            step("07_beyond_ddp/mnist_fsdp2.py", "fsdp"),
            step("07_beyond_ddp/mnist_zero_compile.py", "zero", "--zero"),
            step("07_beyond_ddp/mnist_zero_compile.py", "compile", "--compile", "aot_eager"),
            {"copy": [str(ck / "fsdp"), str(ck / "fsdp3")]},
            {"copy": [str(ck / "fsdp" / "mnist_fsdp2"), str(ck / "fsdp3-saved")]},
            step("07_beyond_ddp/mnist_fsdp2.py", "fsdp3", "--epochs", "3", "--bf16", "on", nproc=3),
            {"script": "07_beyond_ddp/uneven_join.py", "nproc": 2, "args": ["--timeout", "2"],
             "folder": str(tmp_path / "uneven")},
            {"script": "07_beyond_ddp/uneven_join.py", "nproc": 2, "args": ["--timeout", "2", "--join"],
             "folder": str(tmp_path / "join")},
            odd_run(2), odd_run(3)]
    ddp, fsdp, zero, compiled, fsdp3, uneven, join, odd2, odd3 = drive(runs, tmp_path)
    for name, r in (("ddp", ddp), ("fsdp", fsdp), ("zero", zero), ("compile", compiled), ("fsdp3", fsdp3),
                    ("join", join), ("odd2", odd2), ("odd3", odd3)):
        assert r["codes"] == [0] * len(r["codes"]), f"{name}: {r['codes']}\n{r['output'][-3000:]}"

    reference = load(ck / "ddp" / "mnist_torchrun.pt")
    full = load(ck / "fsdp" / "mnist_fsdp2" / "model.pt")
    common.ConvNet().load_state_dict(full, strict=True)  # the gathered checkpoint is a plain ConvNet's state_dict
    assert_close(full, reference["model"], "FSDP2 vs DDP")
    zero_state = load(ck / "zero" / "mnist_zero_compile.pt")
    assert_close(zero_state["model"], reference["model"], "ZeRO vs DDP")
    momentum = {str(i): s["momentum_buffer"] for i, s in zero_state["optimizer"]["state"].items()}
    assert_close(momentum, {str(i): s["momentum_buffer"] for i, s in reference["optimizer"]["state"].items()},
                 "ZeRO's consolidated momentum vs DDP's")
    assert_close(load(ck / "compile" / "mnist_zero_compile.pt")["model"], reference["model"], "compiled vs eager")
    took = {int(n): float(s) for n, s in re.findall(r"^compile: step ([12]) took (\S+) s$", compiled["output"], re.M)}
    assert set(took) == {1, 2}, compiled["output"][-2000:]  # both times are printed (no test judges a speed)
    # what `make fsdp NPROC=2` prints on a CPU, as the README's sample shows it
    assert re.search(r"^2 processes, 2 on this node, on (cpu with gloo|cuda with nccl)\nepoch 1/2: train_loss=\S+ "
                     r"test_loss=\S+ test_acc=\S+\nepoch 2/2: .*\nfinal: test_acc=\S+ test_samples=\d+ "
                     r"world_size=2 epochs=2 seconds=\S+ dataset=mnist-standin$", fsdp["output"], re.M), fsdp["output"]
    # one folder after the run: the shards, .metadata and the full weights of the same epoch
    assert fsdp["listing"] == {"mnist_fsdp2": [".metadata", "__0_0.distcp", "__1_0.distcp", "model.pt"]}, fsdp

    # 1/N of every parameter per rank: rank r wrote rows [r * ceil(n/N), ...) of dimension 0 into __r_0.distcp
    for folder, n in ((ck / "fsdp" / "mnist_fsdp2", 2), (ck / "fsdp3" / "mnist_fsdp2", 3)):
        for key, parts in chunks(folder).items():
            rows = reference["model"][key[len("model."):]].shape[0]
            per = -(-rows // n)
            expected = [(min(per, rows - r * per), f"__{r}_0.distcp") for r in range(n) if rows - r * per > 0]
            assert parts == expected, (folder, key, parts)
    assert "resumed from" in fsdp3["output"] and "after epoch 2" in fsdp3["output"], fsdp3["output"][-2000:]
    assert "world_size=3 epochs=3" in fsdp3["output"]  # with --bf16 on: bf16 compute on the CPU, BatchNorm in float32
    # saved by 2 ranks, read back here by 1 (torch.distributed.checkpoint reshards on load): the weights, bit for bit
    import torch.distributed.checkpoint as dcp

    resharded = {"model": {key: torch.empty_like(value) for key, value in full.items()}}
    dcp.load(resharded, checkpoint_id=str(ck / "fsdp3-saved"))
    for key, value in full.items():
        assert torch.equal(resharded["model"][key], value), key
    losses = [float(x) for x in re.findall(r"test_loss=(\S+)", fsdp["output"] + fsdp3["output"])]
    # the curve continues: epoch 3 (3 ranks) goes on below epoch 2; a new start would be back at epoch 1's level
    assert len(losses) == 3 and losses[2] < losses[1] < losses[0], losses

    # the evaluation: parts that differ by one image, where a batch size of 1000 gives the ranks different counts
    for r, n in ((odd2, 2), (odd3, 3)):
        assert re.search(rf"^final: .* test_samples=6001 world_size={n} ", r["output"], re.M), r["output"][-2000:]
        passes = {rank: [e for e in events if e["ev"] == "loader" and not e["train"]]
                  for rank, events in tracecheck.load(tmp_path / f"odd{n}").items()}
        assert sorted(passes) == list(range(n)) and all(len(p) == 1 for p in passes.values()), passes
        sizes = [len(p[0]["indices"]) for _, p in sorted(passes.items())]
        assert max(sizes) - min(sizes) == 1 and len({math.ceil(size / 1000) for size in sizes}) == 2, sizes
        assert len({p[0]["batches"] for p in passes.values()}) == 1, {k: p[0]["batches"] for k, p in passes.items()}

    assert uneven["codes"] != [0, 0] and "Ranks 1 failed to pass monitoredBarrier in 2000 ms" in uneven["output"], \
        uneven["output"][-3000:]
    assert uneven["seconds"] < 60, "the broken variant ends by its 2 s timeout, not the harness's"
    assert "final: samples=72 world_size=2 join=True" in join["output"]  # 4 + 5 batches of 8


POINTS = {"shards": 1, "weights": 1, "between": 2, "after": 2}  # where rank 0 dies: the epoch a resume continues
FULLY_SHARD = """
import sys
import torch, torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
import common

calls = {"all_gather": 0, "reduce_scatter": 0}  # FSDP2's collectives (torch/distributed/fsdp/_fully_shard/)
for kind, new, old in (("all_gather", "all_gather_single", "all_gather_into_tensor"),
                       ("reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor")):
    name = new if hasattr(dist, new) else old  # the names of torch 2.13 on, the older ones before
    def counted(*args, _call=getattr(dist, name), _kind=kind, **kwargs):
        calls[_kind] += 1
        return _call(*args, **kwargs)
    setattr(dist, name, counted)


def step(model, batch):  # one forward and backward: the collectives it called
    before = dict(calls)
    F.cross_entropy(model(batch[0]), batch[1]).backward()
    return {kind: calls[kind] - before[kind] for kind in calls}


def sharded(reshard_after_forward):
    torch.manual_seed(dist.get_rank())  # a seed per rank: each rank builds its own model
    model = common.ConvNet()
    for block in (model.layer1, model.layer2):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh)
    return model


dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
batches = [(torch.randn(8, 1, 28, 28, generator=g), torch.randint(0, 10, (8,), generator=g))
           for g in (torch.Generator().manual_seed(100 * dist.get_rank() + micro) for micro in range(2))]
model = sharded(True)
out = {"full": {name: p.full_tensor() for name, p in model.named_parameters()}}
model.set_requires_gradient_sync(False)  # gradient accumulation: the first micro-batch keeps its gradients
out["no_sync"] = step(model, batches[0])
model.set_requires_gradient_sync(True)
out["synced"] = step(model, batches[1])
norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
out.update(norm=norm.full_tensor(), norm_type=type(norm).__name__,
           grads={name: p.grad.full_tensor() for name, p in model.named_parameters()})
out["kept"] = step(sharded(False), batches[0])  # the blocks keep their gathered weights from forward to backward
if dist.get_rank() == 0:
    torch.save(out, sys.argv[1])
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.load here, in one process, no group
def test_fsdp2_starts_from_rank_0s_weights_and_a_save_killed_anywhere_resumes_from_the_last_whole_epoch(
        data_dir, tmp_path):
    """fully_shard on 2 ranks (ConvNet, a unit per block and the root): with a seed per rank, its weights are a
    patchwork of the ranks' inits. A forward and backward all-gather 3 units and again the 2 blocks in backward (the
    root keeps its weights), and reduce-scatter 3; with reshard_after_forward=False on the blocks, no all-gather in
    backward; set_requires_gradient_sync(False) skips the reduce-scatters, and the next synced step's gradients are
    those of both micro-batches; clip_grad_norm_ on the sharded gradients returns the global norm (a DTensor) and
    clips them as one model's.
    mnist_fsdp2.py starts from rank 0's weights whatever the seeds (--lr 0: the weights it saves are the ones it
    started from).
    Rank 0 killed at each point of the save of epoch 2: before .metadata, before the full weights, between the two
    renames, before the old folder is removed. A new run continues from the last epoch saved whole and, after its
    next save, leaves one folder whose sharded and full weights are of one epoch, those of a run never killed."""
    import torch.distributed.checkpoint as dcp

    ck = tmp_path / "ck"
    fsdp2 = "07_beyond_ddp/mnist_fsdp2.py"

    def step(name, folder, *extra, **more):
        return {"script": fsdp2, "nproc": 2, "folder": str(tmp_path / "runs" / name), "listing": str(ck / folder),
                "args": [*STANDIN, "--data-dir", str(data_dir), "--checkpoint-dir", str(ck / folder), *extra], **more}

    (tmp_path / "fully_shard.py").write_text(FULLY_SHARD)
    runs = [{"script": str(tmp_path / "fully_shard.py"), "nproc": 2, "args": [str(tmp_path / "fully_shard.pt")],
             "folder": str(tmp_path / "runs" / "fully_shard")},
            step("seeds", "seeds", "--lr", "0", "--epochs", "1", "--max-steps", "1",
                 rank_args=[["--seed", "0"], ["--seed", "1"]]),
            step("base", "base", "--epochs", "1"),
            step("straight", "straight", "--epochs", "3")]
    for point in POINTS:
        runs += [{"copy": [str(ck / "base"), str(ck / point)]},
                 step(f"{point}-killed", point, "--timeout", "10", crash=point),
                 step(f"{point}-resumed", point, "--epochs", "3")]
    sharding, seeds, base, straight, *rest = drive(runs, tmp_path)

    assert sharding["codes"] == [0, 0], sharding["output"][-3000:]
    seen = load(tmp_path / "fully_shard.pt")
    full = seen["full"]
    inits = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        inits.append(dict(common.ConvNet().named_parameters()))
    for name, value in full.items():  # rank r's rows come from rank r's own init: neither rank's model
        half = -(-value.shape[0] // 2)
        assert torch.equal(value[:half], inits[0][name][:half]) and torch.equal(value[half:], inits[1][name][half:])
        if not torch.equal(inits[0][name], inits[1][name]):  # the random ones (BatchNorm starts at 1 and 0)
            assert not torch.equal(value, inits[0][name]) and not torch.equal(value, inits[1][name]), name
    assert any(not torch.equal(a, inits[1][name]) for name, a in inits[0].items())
    assert seen["no_sync"] == {"all_gather": 5, "reduce_scatter": 0}, seen["no_sync"]
    assert seen["synced"] == {"all_gather": 5, "reduce_scatter": 3}, seen["synced"]
    assert seen["kept"] == {"all_gather": 3, "reduce_scatter": 3}, seen["kept"]
    model = common.ConvNet()  # the same step on one process: the whole model, each rank's batches with their own
    model.load_state_dict(full, strict=False)  # BatchNorm statistics, the ranks' losses averaged
    loss = 0
    for rank in (0, 1):
        for micro in (0, 1):
            g = torch.Generator().manual_seed(100 * rank + micro)
            x, y = torch.randn(8, 1, 28, 28, generator=g), torch.randint(0, 10, (8,), generator=g)
            loss = loss + torch.nn.functional.cross_entropy(model(x), y) / 2
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    assert seen["norm_type"] == "DTensor" and torch.allclose(seen["norm"], norm, rtol=1e-5), (seen["norm"], norm)
    assert norm > 1  # so the clipping changed the gradients
    for name, p in model.named_parameters():
        assert torch.allclose(seen["grads"][name], p.grad, rtol=1e-4, atol=1e-7), name
    assert seeds["codes"] == [0, 0], seeds["output"][-3000:]
    started = load(ck / "seeds" / "mnist_fsdp2" / "model.pt")
    for name, value in inits[0].items():  # the course's way: rank 0's init, whole
        assert torch.equal(started[name], value), name

    assert base["codes"] == [0, 0] and straight["codes"] == [0, 0], (base["output"] + straight["output"])[-3000:]
    reference = load(ck / "straight" / "mnist_fsdp2" / "model.pt")
    killed_left = {"shards": {"mnist_fsdp2", "mnist_fsdp2.tmp"}, "weights": {"mnist_fsdp2", "mnist_fsdp2.tmp"},
                   "between": {"mnist_fsdp2.old", "mnist_fsdp2.tmp"}, "after": {"mnist_fsdp2", "mnist_fsdp2.old"}}
    for (point, epoch), killed, resumed in zip(POINTS.items(), rest[0::2], rest[1::2], strict=True):
        assert killed["codes"][0] == 9 and killed["codes"][1] != 0, (point, killed["codes"], killed["output"][-2000:])
        assert set(killed["listing"]) == killed_left[point], (point, killed["listing"])
        if point == "shards":
            assert ".metadata" not in killed["listing"]["mnist_fsdp2.tmp"], killed["listing"]
        if point == "weights":
            assert ".metadata" in killed["listing"]["mnist_fsdp2.tmp"], killed["listing"]
            assert "model.pt" not in killed["listing"]["mnist_fsdp2.tmp"], killed["listing"]
        assert resumed["codes"] == [0, 0], (point, resumed["output"][-3000:])
        assert f"after epoch {epoch}\n" in resumed["output"], (point, resumed["output"][-2000:])
        assert list(resumed["listing"]) == ["mnist_fsdp2"], (point, resumed["listing"])
        folder = ck / point / "mnist_fsdp2"
        weights = load(folder / "model.pt")
        sharded = {"model": {key: torch.empty_like(value) for key, value in weights.items()}, "epoch": 0}
        dcp.load(sharded, checkpoint_id=str(folder))
        assert sharded["epoch"] == 3, (point, sharded["epoch"])
        for key, value in weights.items():
            assert torch.equal(sharded["model"][key], value), (point, key)  # one epoch in the folder
            assert torch.equal(value, reference[key]), (point, key)  # as if never killed


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in this one process, no group
def test_preflight_refuses_a_damaged_half_written_or_foreign_sharded_checkpoint_and_compile_without_cxx(
        data_dir, tmp_path):
    import shutil

    import torch.distributed.checkpoint as dcp

    state = {"model": common.ConvNet().state_dict(), "optimizer": {}, "epoch": 1}
    good = tmp_path / "good" / "mnist_fsdp2"
    dcp.save(state, checkpoint_id=str(good))
    cases = {}
    for name, damage in (("half", lambda f: (f / ".metadata").unlink()),
                         ("cut", lambda f: [p.write_bytes(p.read_bytes()[:100]) for p in f.glob("*.distcp")]),
                         ("garbage", lambda f: (f / ".metadata").write_bytes(b"not a checkpoint"))):
        shutil.copytree(good, tmp_path / name / "mnist_fsdp2")
        damage(tmp_path / name / "mnist_fsdp2")
        cases[name] = tmp_path / name
    dcp.save({"model": common.ToyModel().state_dict(), "epoch": 1}, checkpoint_id=str(tmp_path / "toy" / "mnist_fsdp2"))
    cases["toy"] = tmp_path / "toy"
    before = {p: p.read_bytes() for folder in cases.values() for p in sorted(folder.rglob("*")) if p.is_file()}
    standin = ["--dataset", "mnist-standin", "--data-dir", str(data_dir)]
    calls = [("tools/preflight.py", ["07_beyond_ddp/mnist_fsdp2.py", *standin, "--checkpoint-dir", folder])
             for folder in (tmp_path / "good", *cases.values())]
    calls.append(("tools/preflight.py", ["07_beyond_ddp/mnist_zero_compile.py", *standin, "--compile"]))
    good_run, half, cut, garbage, toy, compile_ = exits(calls, env={"CXX": "no-such-c++-compiler"},
                                                        fresh=True)  # CXX: read as torch is imported
    assert good_run[0] == 0, good_run
    for (code, _, err), words in ((half, "is half-written (no .metadata"), (cut, "is missing or cut short"),
                                  (garbage, ".metadata is damaged"), (toy, "is not a checkpoint of mnist_fsdp2.py"),
                                  (compile_, "--compile on the CPU: inductor builds C++ and finds no C++ compiler")):
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, (code, err)
    after = {p: p.read_bytes() for folder in cases.values() for p in sorted(folder.rglob("*")) if p.is_file()}
    assert after == before, "a refused checkpoint is left as it is"
    assert REPO.joinpath("07_beyond_ddp/mnist_fsdp2.py").exists()


def test_a_bf16_batchnorm_refuses_its_float32_running_statistics():
    """Why mnist_fsdp2.py shards the BatchNorm layers on their own, in float32: with bf16 weights (what
    MixedPrecisionPolicy(param_dtype=torch.bfloat16) makes of them) and its float32 running statistics, BatchNorm
    fails, in training and in evaluation."""
    norm = torch.nn.BatchNorm2d(4)
    norm.weight.data, norm.bias.data = norm.weight.data.bfloat16(), norm.bias.data.bfloat16()
    assert norm.running_mean.dtype == torch.float32
    for train in (True, False):
        norm.train(train)
        with pytest.raises(RuntimeError, match="expected scalar type"):
            norm(torch.randn(2, 4, 3, 3, dtype=torch.bfloat16))


def test_bf16_auto_is_off_on_a_gpu_that_only_emulates_it(monkeypatch):
    """mnist_fsdp2.py's own `bf16 = ...` line, evaluated with the CUDA query mocked: a GPU that computes in bf16
    (A100, H100) gets it; one that only emulates it (V100, T4: torch.cuda.is_bf16_supported() says True unless
    including_emulation=False) does not; the CPU does only with --bf16 on."""
    source = (REPO / "07_beyond_ddp/mnist_fsdp2.py").read_text()
    line = next(node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Assign)
                and [getattr(t, "id", None) for t in node.targets] == ["bf16"])
    decide = compile(ast.Expression(line.value), "mnist_fsdp2.py", "eval")
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    for native in (True, False):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                            lambda including_emulation=True, native=native: native or including_emulation)
        for flag, device, expected in (("auto", cuda, native), ("auto", cpu, False), ("on", cpu, True),
                                       ("off", cuda, False)):
            got = eval(decide, {"torch": torch, "args": argparse.Namespace(bf16=flag), "device": device})
            assert got is expected, (native, flag, device)


def test_uneven_join_waits_5_seconds_by_default():
    """The README's `Ranks 1 failed to pass monitoredBarrier in 5000 ms`: the default --timeout (the test above
    runs it at 2 s and reads 2000 ms)."""
    source = (REPO / "07_beyond_ddp/uneven_join.py").read_text()
    assert re.search(r'"--timeout", type=float, default=5\.0\b', source)


@pytest.mark.slow
def test_the_memory_benchmark_counts_every_ranks_tensors_and_each_methods_buffer(tmp_path):
    """bench/memory.py --quick (the ConvNet at 1 and 2 ranks): the bytes it reports, recomputed here from the model
    alone: DDP and ZeRO add DDP's buckets, another copy of the gradients; FSDP2's rank r holds rows
    [r * ceil(n/2), ...) of every parameter, its gradient and Adam's two moments of them, and gathers one unit at a
    time (the largest: fc, which the root takes)."""
    run([PYTHON, "bench/memory.py", "--quick", "--output-dir", tmp_path], timeout=240)
    record = json.loads(next(tmp_path.glob("memory_gloo_*_quick_*.json")).read_text())
    model = common.ConvNet()
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    units = [model.layer1, model.layer2, model.fc]
    largest = max(sum(p.numel() * p.element_size() for p in unit.parameters()) for unit in units)
    for ws in ("1", "2"):
        for method in ("ddp", "zero"):
            for row in record["per_rank"][f"convnet/{method}"][ws]:
                assert row["params"] == row["grads"] == row["buffer"] == whole, (method, ws, row)
        for rank, row in enumerate(record["per_rank"]["convnet/fsdp2"][ws]):
            pieces = [p.detach().chunk(int(ws)) for p in model.parameters()]  # as fully_shard cuts dimension 0
            mine = sum(c[rank].numel() * c[rank].element_size() for c in pieces if rank < len(c))
            assert row["params"] == row["grads"] == mine and row["optimizer"] == 2 * mine, (ws, rank, row)
            assert row["buffer"] == largest and row["with_buffer"] == row["total"] + largest, (ws, rank, row)
    assert record["per_rank"]["convnet/ddp"]["1"][0]["optimizer"] == 2 * whole  # Adam: two numbers per weight
    md = next(tmp_path.glob("memory_gloo_*_quick_*.md")).read_text()
    assert "tensor bytes per rank" in md and "DDP's gradient buckets" in md and "gathered weights" in md


@pytest.mark.slow
@pytest.mark.cuda
def test_the_memory_benchmark_on_a_gpu_adds_each_ranks_allocator_peak(tmp_path):
    """`bench/memory.py --device cuda`: one rank per GPU over NCCL; each rank's torch.cuda.max_memory_allocated()
    holds at least the tensors counted beside it, and DDP's buckets too, which live as long as the model (FSDP2's
    gathered unit is freed before the optimizer's state is made)."""
    run([PYTHON, "bench/memory.py", "--quick", "--device", "cuda", "--output-dir", tmp_path], timeout=300)
    record = json.loads(next(tmp_path.glob("memory_nccl_*_quick_*.json")).read_text())
    assert record["machine"]["backend"] == "nccl" and record["machine"]["gpus"] >= 1
    for key, by_ws in record["per_rank"].items():
        for ws, rows in by_ws.items():
            assert len(rows) == int(ws) <= torch.cuda.device_count(), (key, ws)
            for row in rows:
                kept = row["with_buffer"] if key.endswith(("/ddp", "/zero")) else row["total"]
                assert row["peak_allocated"] >= kept > 0, (key, ws, row)
