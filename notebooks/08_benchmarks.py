# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---
# %% [markdown]
# # 08 · Benchmarks: what the source notes claim, measured
#
# The source notes say DDP is faster than DataParallel, that collectives beat point-to-point sends, that mixed
# precision pays. `make bench` measures each claim on your machine and writes JSON, a markdown table and a plot per
# benchmark into `runs/bench/`; `make bench BENCH_OUT=bench/results` records them where this notebook looks, named
# by benchmark, backend, machine and date. This notebook reads the newest full results there and shows them;
# [bench/README.md](../bench/README.md) reads the recorded ones for you.
#
# Every benchmark runs each variant once per round, in a rotating order, and computes ratios inside a round: a noisy
# moment of the machine then hits all variants alike. Numbers are medians over the rounds, with the range
# (min-max). After `make bench` on your own machine, run this notebook again to see yours.

# %%
import json
from pathlib import Path

from IPython.display import Image, Markdown, display

RESULTS = Path("../bench/results")


def newest(bench):
    """The newest full (not --quick) result of one benchmark, by the date it was measured."""
    runs = [json.loads(p.read_text()) | {"_path": p} for p in RESULTS.glob(f"{bench}_*.json")]
    runs = [r for r in runs if not r.get("quick")]
    assert runs, f"no {bench} results in {RESULTS}: run make bench"
    return max(runs, key=lambda r: r["machine"]["date"])


def display_result(run):
    print("from", run["_path"].name)
    display(Markdown(run["_path"].with_suffix(".md").read_text()))
    display(Image(filename=str(run["_path"].with_suffix(".png"))))


results = {b: newest(b) for b in ("throughput", "amp", "buckets", "allreduce_sweep")}

# %% [markdown]
# ## 1-2 · Throughput: DataParallel, DDP, launchers, and the data path
#
# The seed's ConvNet on MNIST-shaped data. *plain* is the bare loop with the batches already on the device; the
# course's data path and torchvision's per-image loader show what feeding the model costs; DataParallel and DDP at
# world size 1 show what the wrappers cost; `mp.spawn` and `torchrun` at world size 2 show what a second process
# brings. *One worker's share* is DDP at world size 1 on half of the cores: the baseline for scaling efficiency.

# %% tags=["nbval-ignore-output"]
run = results["throughput"]
display_result(run)
ratios = run["ratios"]
print(f"DDP overhead at world size 1: {ratios['ddp_ws1_overhead']['median']:+.1%}")
for key in (k for k in ratios if k.startswith(("speedup", "efficiency"))):
    print(f"{ratios[key]['meaning']}: {ratios[key]['median']:.2f}")

# %% tags=["check"] jupyter={"source_hidden": true}
# the notebook's own checks (make test runs them; collapsed in Jupyter)
assert {"plain", "course", "dataparallel", "ddp_ws1"} <= set(run["results"])

# %% [markdown]
# ## 3-4 · Collective bandwidth, and a ring of sends against all_reduce
#
# Latency, algorithm bandwidth and bus bandwidth (nccl-tests' definitions) from 4 KB to 256 MB, with one
# process's memory copy bandwidth as the dashed limit. `ring_p2p` is an all_reduce built from `isend`/`irecv`
# around a ring: the same bytes, moved by hand.

# %% tags=["nbval-ignore-output"]
run = results["allreduce_sweep"]
print("from", run["_path"].name)
display(Image(filename=str(run["_path"].with_suffix(".png"))))
rows = {(r["op"], r["bytes"]): r for r in run["rows"]}
small, big = min(r["bytes"] for r in run["rows"]), max(r["bytes"] for r in run["rows"])
print(f"all_reduce: {rows['all_reduce', small]['latency_us']:.0f} us at {small >> 10} KB, "
      f"{rows['all_reduce', big]['busbw_GBps']:.2f} GB/s bus bandwidth at {big >> 20} MB; "
      f"memory copy {run['memcpy_GBps']:.1f} GB/s")
for r in run["ring_vs_all_reduce"]:
    print(f"{r['bytes']:>10} bytes: ring / all_reduce time = {r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})")

# %% tags=["check"] jupyter={"source_hidden": true}
# the notebook's own checks (make test runs them; collapsed in Jupyter)
assert all(r["busbw_GBps"] > 0 for r in run["rows"])

# %% [markdown]
# ## 5 · Mixed precision
#
# fp32 against bf16 autocast (and fp16 with a GradScaler on CUDA) for the ConvNet and ResNet-18, one process.
# Whether bf16 pays on a CPU depends on its instructions (`avx512_bf16`, `amx_bf16`): the JSON lists them.

# %% tags=["nbval-ignore-output"]
run = results["amp"]
display_result(run)
print("CPU features:", run["machine"]["cpu_flags"])

# %% tags=["check"] jupyter={"source_hidden": true}
# the notebook's own checks (make test runs them; collapsed in Jupyter)
assert all(v > 0 for v in (s["median"] for s in run["results"].values()))

# %% [markdown]
# ## 6 · DDP's bucket size
#
# ResNet-18 under DDP with 2 processes, `bucket_cap_mb` from 1 to 100 MB, and `no_sync` (no communication at
# all) as the ceiling.

# %% tags=["nbval-ignore-output"]
run = results["buckets"]
display_result(run)

# %% tags=["check"] jupyter={"source_hidden": true}
# the notebook's own checks (make test runs them; collapsed in Jupyter)
assert run["buckets"]["1 MB"] > run["buckets"]["100 MB"]
