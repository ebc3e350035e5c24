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
# # 06 · Mixed precision and SyncBatchNorm
#
# What `mnist_amp_syncbn.py` adds to the torchrun step, two short runs with 2 processes (full precision, and
# `--amp auto`: bf16 on a CPU and on recent GPUs, fp16 with a GradScaler on older ones) with their training losses
# side by side, then what BatchNorm sees on each rank versus what SyncBatchNorm computes. The
# [section README](../06_amp_syncbn/README.md) explains both.

# %% [markdown]
# ## The training step with autocast and a GradScaler
#
# The forward runs under `torch.autocast`; the scaler multiplies the loss before backward and divides the gradients
# again (`unscale_`) before clipping and the step:

# %%
from nbhelpers import final, records, run, show

show("06_amp_syncbn/mnist_amp_syncbn.py", marked="AMP:")

# %% tags=["nbval-skip"]
import tempfile

from nbhelpers import checks

args = "--dataset mnist-standin --epochs 1 --max-steps 120 --log-every 10 --sync-bn"
runs, traces = {}, {}
for amp in ("off", "auto"):
    traces[amp] = tempfile.mkdtemp()  # recorded from outside: do both ranks end with the same weights and buffers?
    runs[amp] = run(f"make --no-print-directory amp-syncbn NPROC=2 ARGS='{args} --amp {amp}'", quiet=True,
                    trace=traces[amp])
    print(f"--amp {amp}:", runs[amp].strip().splitlines()[-1])

# %% tags=["nbval-skip", "check"] jupyter={"source_hidden": true}
# the notebook's own checks (make test runs them; collapsed in Jupyter)
for amp, out in runs.items():
    summary, verdicts = final(out), checks(traces[amp])
    same = verdicts["ddp"][0] == "ok" and verdicts["buffers"][0] == "ok"
    print(f"--amp {amp}: test_samples={summary['test_samples']} amp={summary['amp']} sync_bn={summary['sync_bn']}"
          f"; same weights and buffers on both ranks: {same}")
    assert summary["test_samples"] == 4000 and same

# %% tags=["nbval-skip"]
import matplotlib.pyplot as plt

plt.figure(figsize=(6, 3.2))
for amp, out in runs.items():
    steps = records(out, "step")
    label = "fp32" if amp == "off" else f"mixed ({final(out)['amp']})"
    plt.plot([s["step"] for s in steps], [s["loss"] for s in steps], label=label)
plt.xlabel("step")
plt.ylabel("training loss (rank 0)")
plt.legend()
plt.tight_layout()
plt.show()
accs = [final(out)["test_acc"] for out in runs.values()]

# %% tags=["nbval-skip", "check"] jupyter={"source_hidden": true}
# the notebook's own checks (make test runs them; collapsed in Jupyter)
assert abs(accs[0] - accs[1]) < 0.02

# %% [markdown]
# ## What BatchNorm sees on each rank
#
# A batch of 8 images split over 2 ranks: plain BatchNorm normalises each half with its own mean and variance;
# SyncBatchNorm (and `AllReduceBatchNorm2d` on CPUs) uses the statistics of all 8. The numbers below are one
# channel's statistics, computed directly.

# %%
import torch

g = torch.Generator().manual_seed(0)
batch = torch.randn(8, 1, 4, 4, generator=g) * 2 + 1
batch[4:] += 1.5  # the second rank's images happen to be brighter
halves = batch.chunk(2)
print(f"{'':<24}{'mean':>8}{'variance':>10}")
for r, half in enumerate(halves):
    print(f"{'BatchNorm on rank ' + str(r):<24}{half.mean():>8.3f}{half.var(unbiased=False):>10.3f}")
print(f"{'SyncBatchNorm (all 8)':<24}{batch.mean():>8.3f}{batch.var(unbiased=False):>10.3f}")

# %% [markdown]
# The all_reduce batch norm in three steps: each rank sums x and x² over its own samples, one all_reduce adds the
# sums of every rank, and every rank normalises with the global mean and variance.

# %%
show("06_amp_syncbn/syncbn_by_hand.py", "AllReduceBatchNorm2d")

# %% tags=["nbval-skip"]
out = run("make --no-print-directory syncbn-proof NPROC=2")

# %% tags=["nbval-skip", "check"] jupyter={"source_hidden": true}
# the notebook's own checks (make test runs them; collapsed in Jupyter)
assert "equal=True" in out
