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
# # 02 · DDP started with mp.spawn
#
# One process per device; DDP averages gradients with an all-reduce during backward. The notebook runs the scripts
# as subprocesses: `mp.spawn` cannot start a function defined in a notebook cell (the child processes import the
# main module to find it, and a notebook has none they can import). The
# [section README](../02_ddp_spawn/README.md) explains how it all works.

# %% [markdown]
# ## The change from the baseline
#
# Every line about distribution in `mnist_spawn.py` carries a `# DDP:` comment. Here they are, read from the
# script, and the function each process runs:

# %%
from nbhelpers import final, records, run, show

show("02_ddp_spawn/mnist_spawn.py", "main_worker", marked="DDP:")

# %% [markdown]
# ## The toy demo: different data, identical weights
#
# Each rank feeds different random data through `DDP(ToyModel)` for one step; afterwards all ranks hold exactly the
# same weights, because the gradients were averaged.

# %% tags=["nbval-skip"]
# (the tests run this demo themselves: tests/test_02_ddp_spawn.py; nbval skips it to save time)
out = run("python 02_ddp_spawn/ddp_basics.py basic --nproc 2")

# %% tags=["nbval-skip", "check"] jupyter={"source_hidden": true}
# the notebook's own checks (make test runs them; collapsed in Jupyter)
assert "all 2 ranks hold the same weights: True" in out

# %% [markdown]
# ## DDP equals one big batch
#
# `ddp_equivalence.py` trains N ranks with 32 samples each and compares with one process on all N×32 samples.
# Without BatchNorm the weights agree to float rounding; with BatchNorm they do not (each rank normalises with its
# own slice's statistics) unless the single-process reference also runs BatchNorm per slice.

# %% tags=["nbval-skip"]
# (the tests run this proof themselves: tests/test_02_ddp_spawn.py; nbval skips it to save time)
out = run("python 02_ddp_spawn/ddp_equivalence.py --nproc 2")

# %% tags=["nbval-skip", "check"] jupyter={"source_hidden": true}
# the notebook's own checks (make test runs them; collapsed in Jupyter)
assert "gradients_averaged=True" in out

# %% [markdown]
# ## Each rank its own shard
#
# The course's tracer (`tools/tracer.py`, switched on by `run(..., trace=DIR)`) records, in every process, which
# sample indices its loader hands out and the model's weights at the end. `shards(DIR)` lists per rank and epoch
# how many samples it trained on and the first few; `checks(DIR)` judges the run. The two ranks' shards together
# hold every training image once, each rank's order changes from epoch to epoch (`sampler.set_epoch`), and all
# ranks end with the same weights and BatchNorm buffers.

# %% tags=["nbval-skip"]
# (the tests run this script traced themselves: tests/test_02_ddp_spawn.py; nbval skips it to save time)
import tempfile

from nbhelpers import checks, shards

trace = tempfile.mkdtemp()
out = run("python 02_ddp_spawn/mnist_spawn.py --nproc 2 --dataset mnist-standin --epochs 2 --max-steps 5",
          quiet=True, trace=trace)
for row in shards(trace):
    print(f"rank {row['rank']}, epoch {row['epoch']}: {row['samples']} samples, first {row['first']}")

# %% tags=["nbval-skip", "check"] jupyter={"source_hidden": true}
# the notebook's own checks (make test runs them; collapsed in Jupyter)
verdicts = checks(trace)
for name in ("shards", "order", "ddp", "buffers"):
    print(f"{name}: {verdicts[name][0]} ({verdicts[name][1]})")
assert sum(r["samples"] for r in shards(trace) if r["epoch"] == 1) == 24000
assert all(verdicts[name][0] == "ok" for name in ("shards", "order", "ddp", "buffers"))

# %% [markdown]
# ## MNIST on 1 and 2 processes
#
# The same short run with `--nproc 1` and `--nproc 2`. Each process takes batches of 64, so 2 processes take 128
# samples per step and need half the steps per epoch. The loss is logged every 5 steps on rank 0.

# %% tags=["nbval-skip"]
args = "--dataset mnist-standin --epochs 1 --max-steps 90 --log-every 5"
runs = {n: run(f"python 02_ddp_spawn/mnist_spawn.py --nproc {n} {args}", quiet=True) for n in (1, 2)}
for n, out in runs.items():
    print(f"{n} process(es):", out.strip().splitlines()[-1])
    assert final(out)["world_size"] == n and final(out)["test_samples"] == 4000

# %% tags=["nbval-skip"]
import matplotlib.pyplot as plt

fig, (by_step, by_sample) = plt.subplots(1, 2, figsize=(10, 3.5), sharey=True)
for n, out in runs.items():
    steps = records(out, "step")
    by_step.plot([s["step"] for s in steps], [s["loss"] for s in steps], label=f"{n} process(es)")
    by_sample.plot([s["step"] * 64 * n for s in steps], [s["loss"] for s in steps], label=f"{n} process(es)")
by_step.set(xlabel="optimizer step", ylabel="training loss (rank 0)", title="per step")
by_sample.set(xlabel="samples seen (all ranks)", title="per sample")
by_step.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# Each step of two processes averages the gradients of 128 samples instead of 64: a less noisy step, but with the
# same learning rate not a bigger one; compare the two runs' last lines above, after the same number of steps.
# Per sample seen, two processes take half the steps for the same data. (Scaling the learning rate with the number
# of processes is a common rule of thumb; the course keeps it fixed so that the runs compare directly.)

# %% [markdown]
# ## Backward and the all-reduce, seen on a timeline
#
# DDP does not wait for backward to finish: it groups the gradients into buckets (25 MB, the first 1 MB), and as
# soon as every gradient of a bucket is computed, the bucket's all-reduce starts while backward goes on with the
# earlier layers. `make ddp-timeline NPROC=2` (`02_ddp_spawn/ddp_timeline.py`) profiles a few steps of ResNet-18 on
# every rank and draws them; the picture below is the recorded run in `bench/results/timeline_gloo_cpu2/`. Left,
# DDP's default buckets; middle, one huge bucket (nothing can start before the last gradient); right, 4
# micro-batches of gradient accumulation with `no_sync()` (no communication until the last one). Grey is the time
# `backward()` still waits for the all-reduce after its own compute has ended; an all-reduce lasts until the
# slowest rank has its bucket ready too.

# %%
import json

from IPython.display import Image, display

from nbhelpers import REPO

record = REPO / "bench/results/timeline_gloo_cpu2"
display(Image(filename=str(record / "timeline_resnet18.png")))
results = json.loads((record / "timeline.json").read_text())["results"]
for name in ("resnet18/default", "resnet18/one-bucket", "resnet18/no-sync"):
    r = results[name]
    print(f"{name:20s} {r['buckets']} bucket(s), {r['hidden_share']:.0%} of the all-reduce time under backward")
# what the text says of this run: several buckets hide most of the all-reduce under backward, one bucket none

# %% tags=["check"] jupyter={"source_hidden": true}
# the notebook's own checks (make test runs them; collapsed in Jupyter)
assert results["resnet18/default"]["hidden_share"] > 0.5 and results["resnet18/no-sync"]["hidden_share"] > 0.5
assert results["resnet18/one-bucket"]["buckets"] == 1 and results["resnet18/one-bucket"]["hidden_share"] == 0

# %% [markdown]
# Next: [03_ddp_torchrun.ipynb](03_ddp_torchrun.ipynb) starts the same training with `torchrun`.
