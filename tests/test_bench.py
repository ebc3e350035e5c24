"""The benchmarks: their shared statistics, the recorded results, and a smoke run of `make bench-quick` that must
produce well-formed results (JSON, markdown, PNG) for every benchmark. No speed is judged here: a measured speed
only has to be a finite, positive number."""

import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

import common
from harness import REPO, make

sys.path.insert(0, str(REPO / "bench"))
import benchlib  # noqa: E402

BENCHES = {  # name: what its JSON must hold besides the machine
    "throughput": ["results", "ratios", "startup_s", "per_round"],
    "amp": ["results", "ratios", "final_loss", "per_round"],
    "buckets": ["results", "ratios", "buckets", "per_round"],
    "allreduce_sweep": ["rows", "ring_vs_all_reduce", "memcpy_GBps"],
    "comm_hooks": ["results", "ratios", "config"],
}


def test_summarize_median_range_and_spread():
    s = benchlib.summarize([3.0, 1.0, 2.0, 10.0])
    assert s == {"median": 2.5, "min": 1.0, "max": 10.0, "spread": 9.0 / 2.5, "rounds": 4}
    assert benchlib.summarize([5])["spread"] == 0.0


def test_rotated_order_starts_each_round_with_the_next_variant():
    items = ["a", "b", "c"]
    orders = [benchlib.rotated(items, r) for r in range(4)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert all(sorted(o) == items for o in orders)  # every variant once per round


def test_every_recorded_number_was_measured_without_a_gpu():
    """The READMEs say no GPU run is recorded yet: every record in bench/results says so of its machine."""
    records = sorted((REPO / "bench" / "results").glob("*.json"))
    assert len(records) >= 8
    for path in records:
        machine = json.loads(path.read_text())["machine"]
        assert machine["gpus"] == 0 and not path.name.startswith("gpu_check"), path.name


def test_results_with_nan_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"result\.rows\[1\]\.x is nan"):
        benchlib.write_results(tmp_path, "broken", {"rows": [{"x": 1.0}, {"x": float("nan")}]}, ["x"])
    assert not list(tmp_path.iterdir()), "nothing may be written for a broken measurement"


def test_file_names_carry_benchmark_backend_machine_and_date():
    import torch

    name = benchlib.stem("amp", torch.device("cpu"), "gloo", quick=True)
    bench, backend, machine, quick, date = name.split("_")
    assert (bench, backend, quick) == ("amp", "gloo", "quick")
    assert machine == f"cpu{benchlib.usable_cores()}" and len(date) == 10


def well_formed(summary: dict, positive: bool = True) -> bool:
    """Finite floats with min <= median <= max (and above 0, for speeds; an overhead may be negative)."""
    return all(isinstance(summary[k], float) and math.isfinite(summary[k]) for k in ("median", "min", "max")) \
        and summary["min"] <= summary["median"] <= summary["max"] and (summary["min"] > 0 or not positive)


def assert_rotated(per_round: list[dict], name: str) -> None:
    """The rounds as the JSON keeps them (in the order the variants ran): every variant once per round, round r
    starting with variant r, so no variant always runs first."""
    names = list(per_round[0])
    for r, results in enumerate(per_round):
        assert list(results) == benchlib.rotated(names, r), f"{name}: round {r + 1} ran in the order {list(results)}"


@pytest.mark.parametrize("record", sorted(p.name for p in (REPO / "bench/results").glob("*.json")
                                          if "per_round" in json.loads(p.read_text())
                                          and isinstance(json.loads(p.read_text())["per_round"][0], dict)
                                          and not p.name.startswith("versions_")))
def test_every_recorded_benchmark_ran_its_variants_in_a_rotating_order(record):
    per_round = json.loads((REPO / "bench/results" / record).read_text())["per_round"]
    assert len(per_round) >= 3 and len(per_round[0]) >= 2, "a rotation needs rounds and variants to show"
    assert_rotated(per_round, record)


TARGETS = {"throughput": "bench-throughput", "amp": "bench-amp", "buckets": "bench-buckets",
           "allreduce_sweep": "bench-allreduce", "comm_hooks": "bench-hooks"}


def test_bench_quick_runs_every_benchmark_at_its_quick_sizes():
    """`make bench-quick` is each benchmark's target with QUICK=--quick, one after another: the test below runs
    each of them so, side by side with the other tests instead of in one long row."""
    recipe = re.search(r"^bench-quick:.*\n\t(.*\n(?:\t.*\n)*)", (REPO / "Makefile").read_text(), re.M)[1]
    assert "QUICK=--quick" in recipe and sorted(re.findall(r"\b(bench-[a-z]+)\b", recipe)) == sorted(TARGETS.values())
    assert set(TARGETS) == set(BENCHES)


@pytest.mark.slow
@pytest.mark.parametrize("bench", list(BENCHES))
def test_bench_quick_writes_well_formed_results(bench, tmp_path, data_dir):
    """What `make bench-quick` runs for this benchmark: its JSON, markdown table and PNG are well formed."""
    out = tmp_path / "results"
    launched = ["NPROC=2"] if bench in ("buckets", "allreduce_sweep", "comm_hooks") else []  # not one per GPU
    result = make(TARGETS[bench], "ARGS=", "QUICK=--quick", f"BENCH_OUT={out}", f"BENCH_DATA={data_dir}", *launched,
                  timeout=240)
    keys = BENCHES[bench]
    found = sorted(out.glob(f"{bench}_*_quick_*.json"))
    assert len(found) == 1, f"{bench}: expected one JSON file, found {found}\n{result.tail()}"
    stem = found[0].with_suffix("")
    data = json.loads(found[0].read_text())
    assert data["bench"] == bench and data["quick"] is True
    machine = data["machine"]
    assert machine["cores"] >= 1 and machine["torch"] and machine["cpu"], machine
    assert {"cpu_flags", "gpu", "gpus", "cuda", "backend"} <= set(machine), machine  # features, GPU, CUDA
    assert all(k in data for k in keys), f"{bench}: missing {[k for k in keys if k not in data]}"
    md = stem.with_suffix(".md").read_text()
    assert md.startswith("# ") and "| ---" in md, f"{bench}: no markdown table"
    assert "> Quick run" in md, f"{bench}: a quick table must say that it is one"
    png = stem.with_suffix(".png")
    if importlib.util.find_spec("matplotlib"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{bench}: not a PNG"
    else:  # an interpreter without matplotlib (a GPU host's, say): one line says why there is no picture
        assert not png.exists() and result.stdout.splitlines().count(benchlib.no_plot_line(png)) == 1, result.tail()
    if "per_round" in data:  # measured in rounds: median, min and max
        assert data["results"] and all(well_formed(s) for s in data["results"].values()), data["results"]
        assert_rotated(data["per_round"], bench)
        assert all(well_formed(s, positive=not k.endswith("overhead")) for k, s in data["ratios"].items())
    {"throughput": throughput_well_formed, "amp": amp_well_formed, "buckets": buckets_well_formed,
     "allreduce_sweep": sweep_well_formed, "comm_hooks": hooks_well_formed}[bench](data)


def throughput_well_formed(throughput: dict) -> None:
    sizes = throughput["config"]["world_sizes"]  # quick: 2 where the cores or GPUs allow; none on 1 GPU
    room = common.usable_gpus() if throughput["config"]["device"] == "cuda" else throughput["config"]["cores"]
    assert sizes == ([2] if room >= 2 else []), sizes
    launched = {f"{launcher}_ws{n}" for n in sizes for launcher in ("spawn", "torchrun")}
    expected = {"plain", "course", "torchvision", "dataparallel", "ddp_ws1"} | launched
    assert expected <= set(throughput["results"]), sorted(throughput["results"])
    assert {"ddp_ws1_overhead"} | {f"{r}_ws{n}" for n in sizes for r in ("speedup", "efficiency")} \
        <= set(throughput["ratios"])
    assert set(throughput["startup_s"]) == launched
    assert sizes or throughput["note"], "no multi-process variant must come with a note saying why"


def amp_well_formed(amp: dict) -> None:
    lower = "bf16" if amp["config"]["device"] == "cpu" else "fp16"  # fp16 runs on every GPU; bf16 on CPUs here
    assert {f"{m}/{p}" for m in ("convnet", "resnet18") for p in ("fp32", lower)} <= set(amp["results"])
    if amp["config"]["device"] == "cuda" and common.usable_gpus() and torch.cuda.get_device_capability() >= (8, 0):
        assert {"convnet/tf32", "resnet18/tf32"} <= set(amp["results"]), "TF32 on a GPU that has it"
    assert all(math.isfinite(v) for v in amp["final_loss"].values())


def buckets_well_formed(buckets: dict) -> None:
    assert buckets["buckets"]["1 MB"] > buckets["buckets"]["25 MB"] >= 1, buckets["buckets"]


def hooks_well_formed(hooks: dict) -> None:
    assert set(hooks["results"]) == {f"{m}/{h}" for m in ("convnet", "resnet18")
                                     for h in ("all_reduce", "fp16", "bf16", "powersgd")}
    for model in ("convnet", "resnet18"):  # 16-bit hooks send half the bytes of the default, exactly
        full = hooks["results"][f"{model}/all_reduce"]["mb_per_step"]
        assert full > 0 and all(hooks["results"][f"{model}/{h}"]["mb_per_step"] == full / 2 for h in ("fp16", "bf16"))
        assert all(math.isfinite(r["final_loss"]) and r["images_per_s"] > 0 for r in hooks["results"].values())
    assert 0 < hooks["results"]["convnet/powersgd"]["test_acc"] <= 1
    # quick: 4 ConvNet steps, PowerSGD compresses from the third on, so it must have sent fewer bytes in all
    assert hooks["results"]["convnet/powersgd"]["mb_per_step"] < hooks["results"]["convnet/all_reduce"]["mb_per_step"]


def sweep_well_formed(sweep: dict) -> None:
    ops = {row["op"] for row in sweep["rows"]}
    assert ops == {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "ring_p2p"}
    assert all(row["latency_us"] > 0 and row["busbw_GBps"] > 0 for row in sweep["rows"])
    assert sweep["memcpy_GBps"] > 0


RECORDS = REPO / "bench" / "results"


def test_one_record_of_each_benchmark_is_kept_and_the_older_names_are_the_ones_the_readme_lists():
    """bench/README.md: one run of each benchmark is recorded; amp's record has no backend part, backend_matrix's
    machine part has no core count, the timeline is a folder of its own."""
    for bench in ("throughput", "amp", "buckets", "allreduce_sweep", "comm_hooks", "memory", "versions",
                  "stress_elastic", "stress_exit", "stress_free"):
        assert len(list(RECORDS.glob(f"{bench}_*.json"))) == 1, bench
    assert [p.name for p in RECORDS.glob("amp_*.json")] == ["amp_cpu2_2026-11-22.json"]
    assert [p.name for p in RECORDS.glob("backend_matrix_*")] == ["backend_matrix_gloo_cpu_2026-11-22.md"]
    assert (RECORDS / "timeline_gloo_cpu2" / "timeline.json").is_file()


def test_results_go_to_runs_bench_which_git_ignores_unless_recorded():
    import re

    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^BENCH_OUT\s*\?=\s*runs/bench$", makefile, re.M)
    assert "BENCH_OUT=$(if $(filter runs/bench,$(BENCH_OUT)),runs/bench/quick,$(BENCH_OUT))" in makefile  # quick
    assert "runs/" in (REPO / ".gitignore").read_text().split()
    assert re.search(r"^RUNS\s*\?=\s*10$", makefile, re.M)  # the stress targets' runs of each kind


def test_the_recorded_ratios_were_taken_inside_each_round():
    """throughput's ratios are medians of one ratio per round, not ratios of the medians; its .md table's "vs
    plain" column is the other kind, a ratio of the medians."""
    import re

    import throughput

    record = json.loads((RECORDS / "throughput_gloo_cpu2_2026-11-22.json").read_text())
    rounds = record["per_round"]
    sizes = [int(k[len("speedup_ws"):]) for k in record["ratios"] if k.startswith("speedup_ws")]
    for key, _, ratio in throughput.ratio_definitions(torch.device("cpu"), sizes):
        recorded = record["ratios"][key]["median"]
        assert benchlib.summarize([ratio(r) for r in rounds])["median"] == pytest.approx(recorded), key
    results = record["results"]
    md = (RECORDS / "throughput_gloo_cpu2_2026-11-22.md").read_text()
    for label, key in (("course data path", "course"), ("torchvision per-image loader", "torchvision"),
                       ("nn.DataParallel", "dataparallel"), ("DDP ws 2, torchrun", "torchrun_ws2")):
        shown = float(re.search(rf"^\| {re.escape(label)} \| [^|]+ \| ([\d.]+)x \|$", md, re.M)[1])
        assert shown == round(results[key]["median"] / results["plain"]["median"], 2), label


def test_warm_up_steps_are_not_timed():
    calls = []

    def step():
        calls.append(1)
        return 10  # images

    images, seconds = benchlib.time_steps(step, warmup=2, steps=3, device=torch.device("cpu"))
    assert len(calls) == 5 and images == 30 and seconds >= 0
    for name in ("throughput_gloo_cpu2_2026-11-22.json", "amp_cpu2_2026-11-22.json",
                 "buckets_gloo_cpu2_2026-11-22.json"):
        assert json.loads((RECORDS / name).read_text())["config"]["warmup"] >= 1, name


def test_resnet18s_last_convolutions_hold_more_than_5_mb_each():
    """Why a 5 MB bucket cap gives fewer buckets than 45 MB / 5 MB: one such weight is bigger than the cap."""
    net = common.resnet18_cifar()
    last = [m for m in net.layer4.modules() if isinstance(m, torch.nn.Conv2d) and m.kernel_size == (3, 3)]
    assert len(last) == 4 and all(tuple(m.weight.shape) == (512, 512, 3, 3) for m in last[1:])
    assert all(m.weight.numel() * 4 > 5 * 2**20 for m in last[1:])


def test_gpu_check_rewrites_its_file_after_every_step_and_exits_1_if_a_step_failed(monkeypatch, tmp_path):
    """A part stopped from outside keeps the steps it finished; a failed step's log goes into the one tar.gz; the
    limits add up to at most the figure bench/README.md gives."""
    import shlex
    import tarfile

    import gpu_check

    assert f"add up to at most {gpu_check.COMMAND_LIMIT_S} s" in (REPO / "bench/README.md").read_text()
    before = []

    def fake_step(step, tag=None, py=None, linger=5.0, stop=None):
        written = sorted(tmp_path.glob("gpu_check_*.json"))
        before.append([r["step"] for r in json.loads(written[0].read_text())["steps"]] if written else [])
        passed = len(before) != 2
        return {"step": step.name, "group": step.group, "passed": passed, "why": None if passed else "exit code 1",
                "started": 0.0, "seconds": 0.1, "timeout": step.timeout, "note": "", "command": shlex.join(step.cmd),
                "final": {}, **({} if passed else {"log": "what it printed"})}

    monkeypatch.setattr(gpu_check, "run_step", fake_step)
    monkeypatch.setattr(gpu_check, "can_make_netns", lambda: False)
    monkeypatch.setattr(gpu_check.signal, "signal", lambda *args: None)
    monkeypatch.chdir(REPO)
    code = gpu_check.main(["--rehearse", "--gpus", "1", "--part", "targets-1", "--output-dir", str(tmp_path)])
    steps = [s.name for s in gpu_check.parts(gpu_check.plan(1))["targets-1"]]
    assert code == 1 and len(steps) >= 3
    assert before == [steps[:i] for i in range(len(steps))], "the file holds every finished step, step by step"
    logs = list(tmp_path.glob("gpu_check_targets-1_*_logs.tar.gz"))
    with tarfile.open(logs[0]) as tar:
        assert [Path(n).name for n in tar.getnames()] == [f"{steps[1]}.log"]
        assert tar.extractfile(tar.getnames()[0]).read() == b"what it printed"


def test_benchmarks_refuse_bad_input(tmp_path):
    from harness import exits

    out = ["--output-dir", tmp_path]
    answers = exits([("bench/amp.py", ["--models", "vgg", *out]), ("bench/buckets.py", []),
                     ("bench/throughput.py", ["--steps", "0", *out]),
                     ("bench/throughput.py", ["--world-sizes", "2,0", *out]),
                     ("bench/versions.py", ["--old", "no-such-commit", *out])])
    expected = ["unknown ['vgg']", "start me with torchrun", "--steps must be at least 1",
                "every world size must be at least 1", "error: --old no-such-commit: not a commit of this repository"]
    for (code, _, err), message in zip(answers, expected, strict=True):
        assert code == 2 and message in err, (message, err)
    assert not list(tmp_path.iterdir())


def test_the_elastic_stress_passes_a_run_only_when_compare_checkpoints_says_true():
    import stress

    line = "epochs 2 and 2: 8 tensors, {}, largest difference {}"
    assert stress.recovered(line.format("bitwise identical: True", 0))
    assert stress.recovered(line.format("identical within 1e-05 (trained on a GPU): True", "3.1e-06"))
    assert not stress.recovered(line.format("bitwise identical: False", "0.02"))
    assert not stress.recovered(line.format("identical within 1e-05 (trained on a GPU): False", "0.02"))
    assert not stress.recovered("")


def test_stress_alternates_the_sides_run_by_run_and_counts_each(tmp_path, monkeypatch):
    """bench/stress.py's bookkeeping, on a case of its own that runs nothing: run 1 with the workaround first, run 2
    without it first, and so on; each side's passes counted apart; COURSE_WORKAROUNDS tells each command its side."""
    from types import SimpleNamespace

    import stress

    seen = []

    def case(on, nproc, tmp, timeout, device):
        seen.append(on)
        passed = on or len(seen) != 2  # run 1 without the workaround fails
        return passed, "ok" if passed else "hung (stopped by the timeout)", ""

    monkeypatch.setitem(stress.CASES, "fake", (case, "a case that runs nothing", 5))
    monkeypatch.setattr(stress.common, "prepare_data", lambda *args, **kw: None)
    assert stress.main(["fake", "--runs", "3", "--output-dir", str(tmp_path)]) == 0
    assert seen == [True, False, False, True, True, False]
    record = json.loads(next(tmp_path.glob("stress_fake_*.json")).read_text())
    assert (record["runs"], record["passed_with_workaround"], record["passed_without_workaround"]) == (3, 3, 2)
    assert [(r["run"], r["workaround"], r["passed"]) for r in record["per_run"]][:2] == [(1, True, True),
                                                                                        (1, False, False)]
    envs = []
    monkeypatch.setattr(stress.benchlib, "run_bounded",
                        lambda cmd, timeout, env: envs.append(env["COURSE_WORKAROUNDS"]) or SimpleNamespace(stdout="x"))
    assert stress.outcome(["cmd"], True, 5, ok=lambda out: out == "x")[0]
    assert not stress.outcome(["cmd"], False, 5, ok=lambda out: False)[0]
    assert envs == ["on", "off"]
