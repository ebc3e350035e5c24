"""Section 07: FSDP2, ZeRO, torch.compile with DDP, uneven inputs with Join.

One launch proves most of it: a driver imports torch once and forks the ranks of each run (tools/mutants.run
gives them torchrun's variables), so seven runs cost about what two torchrun jobs would (about 17 core-seconds).
"""

import json
import re

import pytest
import torch

import common
from harness import PYTHON, REPO, exits, run

STANDIN = ["--dataset", "mnist-standin", "--timeout", "30", "--epochs", "2", "--max-steps", "4"]
# the driver: RUNS is a list of [script, nproc, args, folder] (a run) or ["copy", src, dst]
_DRIVER = r"""
import json, shutil, sys, time
from pathlib import Path
import torch._dynamo, torch.distributed.checkpoint, torch.distributed.fsdp  # once here, not in every fork
from tools import mutants
results = []
for step in json.loads(sys.argv[1]):
    if step[0] == "copy":
        shutil.copytree(step[1], step[2])
        continue
    script, nproc, args, folder = step
    start = time.time()
    codes, output = mutants.run(mutants.REPO / script, "torchrun", args, Path(folder), timeout=120, nproc=nproc)
    results.append({"codes": codes, "output": output, "seconds": time.time() - start})
print(json.dumps(results))
"""


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
    end with DDP's weights, to rounding. FSDP2's sharded checkpoint holds 1/N of every parameter per rank's file
    reads back exactly at another world size, and a run at 3 ranks continues its loss curve (in bf16: --bf16 on).
    Uneven inputs: without Join the job ends by its 2 s timeout, naming the ranks; with Join it finishes."""
    data = ["--data-dir", str(data_dir)]
    ck = tmp_path / "ck"

    def step(script, name, *extra, nproc=2):
        return [script, nproc, [*STANDIN, *data, "--checkpoint-dir", str(ck / name), *extra], str(tmp_path / name)]

    runs = [step("03_ddp_torchrun/mnist_torchrun.py", "ddp"),
            step("07_beyond_ddp/mnist_fsdp2.py", "fsdp"),
            step("07_beyond_ddp/mnist_zero_compile.py", "zero", "--zero"),
            step("07_beyond_ddp/mnist_zero_compile.py", "compile", "--compile", "aot_eager"),
            ["copy", str(ck / "fsdp"), str(ck / "fsdp3")],
            ["copy", str(ck / "fsdp" / "mnist_fsdp2"), str(ck / "fsdp3-saved")],
            step("07_beyond_ddp/mnist_fsdp2.py", "fsdp3", "--epochs", "3", "--bf16", "on", nproc=3),
            ["07_beyond_ddp/uneven_join.py", 2, ["--timeout", "2"], str(tmp_path / "uneven")],
            ["07_beyond_ddp/uneven_join.py", 2, ["--timeout", "2", "--join"], str(tmp_path / "join")]]
    res = run([PYTHON, "-c", _DRIVER, json.dumps(runs)], timeout=280)
    ddp, fsdp, zero, compiled, fsdp3, uneven, join = json.loads(res.stdout)
    for name, r in (("ddp", ddp), ("fsdp", fsdp), ("zero", zero), ("compile", compiled), ("fsdp3", fsdp3),
                    ("join", join)):
        assert r["codes"] == [0] * len(r["codes"]), f"{name}: {r['codes']}\n{r['output'][-3000:]}"

    reference = load(ck / "ddp" / "mnist_torchrun.pt")
    full = load(ck / "fsdp" / "mnist_fsdp2_model.pt")
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
    # the lines of the README's sample of `make fsdp NPROC=2` on a CPU, offline (the tests' stand-in is smaller)
    assert re.search(r"^2 processes, 2 on this node, on (cpu with gloo|cuda with nccl)\nepoch 1/2: train_loss=\S+ "
                     r"test_loss=\S+ test_acc=\S+\nepoch 2/2: .*\nfinal: test_acc=\S+ test_samples=\d+ "
                     r"world_size=2 epochs=2 seconds=\S+ dataset=mnist-standin$", fsdp["output"], re.M), fsdp["output"]
    # the sharded folder was written as mnist_fsdp2.tmp/ and swapped in: nothing else is left beside the full weights
    assert sorted(p.name for p in (ck / "fsdp").iterdir()) == ["mnist_fsdp2", "mnist_fsdp2_model.pt"]

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

    assert uneven["codes"] != [0, 0] and "Ranks 1 failed to pass monitoredBarrier in 2000 ms" in uneven["output"], \
        uneven["output"][-3000:]
    assert uneven["seconds"] < 60, "the broken variant ends by its 2 s timeout, not the harness's"
    assert "final: samples=72 world_size=2 join=True" in join["output"]  # 4 + 5 batches of 8


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
    good_run, half, cut, garbage, toy, compile_ = exits(calls, env={"CXX": "no-such-c++-compiler"})
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


def test_uneven_join_waits_5_seconds_by_default():
    """The README's `Ranks 1 failed to pass monitoredBarrier in 5000 ms`: the default --timeout (the test above
    runs it at 2 s and reads 2000 ms)."""
    source = (REPO / "07_beyond_ddp/uneven_join.py").read_text()
    assert re.search(r'"--timeout", type=float, default=5\.0\b', source)
