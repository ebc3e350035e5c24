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
# # 05 · Collectives, with 4 processes
#
# `collectives.py` runs every collective on small tensors and prints, per rank, the value before and after. Here it
# runs with 4 processes (Gloo on CPU tensors, on any machine); the tables for `all_reduce` and `reduce_scatter` are
# drawn as bars. The [section README](../05_collectives/README.md) explains each op, the backends, and the
# evaluation and hang lessons.

# %%
import json
import re

from nbhelpers import run, show

out = run("make --no-print-directory collectives NPROC=4 BACKEND=gloo", quiet=True)


def block(title):
    """The rows of one op's table, [(before, after), ...] per rank: the printed values are JSON lists."""
    lines = out.split(title, 1)[1].splitlines()[1:5]
    return [tuple(json.loads(part) for part in re.match(r"\s+rank \d: (.+?)\s+-> (.+)", ln).groups()) for ln in lines]


for title in ("all_reduce(SUM, float32)", "reduce_scatter(SUM)", "all_to_all_single"):
    print(title)
    for rank, (before, after) in enumerate(block(title)):
        print(f"    rank {rank}: {before} -> {after}")

# %% tags=["check"] jupyter={"source_hidden": true}
# the notebook's own checks (make test runs them; collapsed in Jupyter)
assert "result: all collectives correct" in out and "4 ranks, backend gloo" in out and "[WRONG]" not in out
assert len(re.findall(r"^\S.*  \[OK\]$", out, re.M)) == 21  # every op checked against its closed form
assert "rank 3: [30.0, 31.0, 32.0, 33.0]" in out  # the table shows every rank: rank 3's all_to_all row

# %% tags=["nbval-ignore-output"]
import matplotlib.pyplot as plt

fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
ar = block("all_reduce(SUM, float32)")
ranks = range(len(ar))
axes[0].bar([r - 0.2 for r in ranks], [b[0] for b, _ in ar], width=0.4, label="before")
axes[0].bar([r + 0.2 for r in ranks], [a[0] for _, a in ar], width=0.4, label="after")
axes[0].set(title="all_reduce(SUM): every rank gets the sum", xlabel="rank", xticks=list(ranks), ylim=(0, 13))
axes[0].legend(loc="upper left")
rs = block("reduce_scatter(SUM)")
before = [[p[0] for p in b] for b, _ in rs]  # rank r's piece j
axes[1].imshow(before, cmap="Blues")
for r, row in enumerate(before):
    for j, v in enumerate(row):
        axes[1].text(j, r, f"{v:g}", ha="center", va="center")
for j in ranks:  # what rank j holds afterwards: the sum of column j
    axes[1].text(j, len(ranks) - 0.1, f"{rs[j][1][0]:g}", ha="center", va="top", color="darkred")
axes[1].set(title="reduce_scatter: rank j gets column j's sum (red)", xlabel="piece j = rank j", ylabel="rank r",
            xticks=list(ranks), yticks=list(ranks), ylim=(len(ranks) + 0.4, -0.5))
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Data parallelism by hand
#
# What DDP does, without DDP: start from rank 0's weights, and after every backward add up the gradients of all
# ranks and divide by their number. The whole of it:

# %%
show("05_collectives/ddp_from_scratch.py", "train")

# %% [markdown]
# ## Exact evaluation
#
# A padded `DistributedSampler` counts some test images twice; strided shards and one `reduce` give exactly the
# single-process numbers.

# %% tags=["nbval-skip"]
out = run("make --no-print-directory ddp-eval NPROC=3 ARGS='--subset 10'")

# %% tags=["nbval-skip", "check"] jupyter={"source_hidden": true}
# the notebook's own checks (make test runs them; collapsed in Jupyter)
assert "padded_count=12 exact_count=10 exact_equals_single=True" in out
