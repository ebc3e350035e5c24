"""The benchmarks: their shared statistics, and a smoke run of `make bench-quick` that must produce
well-formed results (JSON, markdown, PNG) for every benchmark. Never a speed: tests do not time things."""

import json
import math
import sys

import pytest

from harness import REPO, make

sys.path.insert(0, str(REPO / "bench"))
import benchlib  # noqa: E402

BENCHES = {  # name: what its JSON must hold besides the machine
    "throughput": ["results", "ratios", "startup_s", "per_round"],
    "amp": ["results", "ratios", "final_loss", "per_round"],
    "buckets": ["results", "ratios", "buckets", "per_round"],
    "allreduce_sweep": ["rows", "ring_vs_all_reduce", "memcpy_GBps"],
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


@pytest.mark.slow
def test_bench_quick_writes_well_formed_results_for_every_benchmark(tmp_path, data_dir):
    out = tmp_path / "results"
    result = make("bench-quick", f"BENCH_OUT={out}", f"BENCH_DATA={data_dir}", timeout=240)
    for bench, keys in BENCHES.items():
        found = sorted(out.glob(f"{bench}_*_quick_*.json"))
        assert len(found) == 1, f"{bench}: expected one JSON file, found {found}\n{result.tail()}"
        stem = found[0].with_suffix("")
        data = json.loads(found[0].read_text())
        assert data["bench"] == bench and data["quick"] is True
        machine = data["machine"]
        assert machine["cores"] >= 1 and machine["torch"] and machine["cpu"], machine
        assert all(k in data for k in keys), f"{bench}: missing {[k for k in keys if k not in data]}"
        md = stem.with_suffix(".md").read_text()
        assert md.startswith("# ") and "| ---" in md, f"{bench}: no markdown table"
        assert "> Quick run" in md, f"{bench}: a quick table must say that it is one"
        assert stem.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{bench}: not a PNG"
        if "results" in data:
            assert data["results"] and all(well_formed(s) for s in data["results"].values()), data["results"]
            assert all(well_formed(s, positive=not k.endswith("overhead")) for k, s in data["ratios"].items())

    throughput = json.loads(next(out.glob("throughput_*.json")).read_text())
    expected = {"plain", "course", "torchvision", "dataparallel", "ddp_ws1", "spawn_ws2", "torchrun_ws2"}
    assert expected <= set(throughput["results"]), sorted(throughput["results"])
    assert {"ddp_ws1_overhead", "speedup_ws2", "efficiency_ws2"} <= set(throughput["ratios"])
    assert set(throughput["startup_s"]) == {"spawn_ws2", "torchrun_ws2"}

    amp = json.loads(next(out.glob("amp_*.json")).read_text())
    assert {"convnet/fp32", "convnet/bf16", "resnet18/fp32", "resnet18/bf16"} <= set(amp["results"])
    assert all(math.isfinite(v) for v in amp["final_loss"].values())

    buckets = json.loads(next(out.glob("buckets_*.json")).read_text())
    assert buckets["buckets"]["1 MB"] > buckets["buckets"]["25 MB"] >= 1, buckets["buckets"]

    sweep = json.loads(next(out.glob("allreduce_sweep_*.json")).read_text())
    ops = {row["op"] for row in sweep["rows"]}
    assert ops == {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "ring_p2p"}
    assert all(row["latency_us"] > 0 and row["busbw_GBps"] > 0 for row in sweep["rows"])
    assert sweep["memcpy_GBps"] > 0


def test_benchmarks_refuse_bad_input(tmp_path):
    from harness import PYTHON, run

    bad = run([PYTHON, REPO / "bench/amp.py", "--models", "vgg", "--output-dir", tmp_path], expect_rc=2)
    assert "unknown ['vgg']" in bad.stderr
    bad = run([PYTHON, REPO / "bench/buckets.py"], expect_rc=2)
    assert "start me with torchrun" in bad.stderr
    bad = run([PYTHON, REPO / "bench/throughput.py", "--steps", "0", "--output-dir", tmp_path], expect_rc=2)
    assert "--steps must be at least 1" in bad.stderr
    bad = run([PYTHON, REPO / "bench/throughput.py", "--world-sizes", "2,0", "--output-dir", tmp_path], expect_rc=2)
    assert "every world size must be at least 1" in bad.stderr
    assert not list(tmp_path.iterdir())
