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
# # 03 · DDP started with torchrun
#
# `torchrun` starts the processes from outside the script and passes each its rank through environment variables
# (`env://`). The [section README](../03_ddp_torchrun/README.md) lists them and explains the options. This notebook
# shows what changed from the `mp.spawn` step, runs the headline command, plots the accuracy per epoch, and runs
# the elastic failure demo.

# %% [markdown]
# ## What the script does differently
#
# No spawning: torchrun runs the script once per process. `main()` reads who it is from the environment, binds its
# GPU, joins the group, and one process per node prepares the data:

# %%
from nbhelpers import final, records, run, show

show("03_ddp_torchrun/mnist_torchrun.py", "main")

# %% [markdown]
# ## The headline run
#
# `make ddp-torchrun NPROC=2`: two processes, CPU + Gloo here, one GPU each + NCCL on a GPU machine. Three short
# epochs of 60 steps this time, to have a curve to draw quickly.

# %% tags=["nbval-skip"]
out = run("make --no-print-directory ddp-torchrun NPROC=2 EPOCHS=3 DATASET=mnist-standin ARGS='--max-steps 60'")
summary = final(out)
assert summary["world_size"] == 2 and summary["test_samples"] == 4000 and summary["ranks_agree"] == "True"

# %% tags=["nbval-skip"]
import matplotlib.pyplot as plt

acc = [e["test_acc"] for e in records(out, "epoch")]
plt.figure(figsize=(5, 3))
plt.plot(range(1, len(acc) + 1), acc, marker="o")
plt.xticks(range(1, len(acc) + 1))
plt.xlabel("epoch")
plt.ylabel("test accuracy (all 4000 images)")
plt.title("mnist_torchrun.py, 2 processes")
plt.tight_layout()
plt.show()
assert acc[-1] > acc[0]

# %% [markdown]
# ## A worker fails; torchrun restarts the group; training resumes
#
# `make elastic-restart` runs the training twice on short epochs: uninterrupted, and with `--max-restarts 1` while
# rank 1 raises at step 20 on the first attempt. The lines below are picked from its log: the failure, the restart
# (`restart 1`), the resume from the epoch-1 checkpoint, and the comparison of the final weights.

# %% tags=["nbval-skip"]
# (the tests run this demo themselves: tests/test_03_ddp_torchrun.py; nbval skips it to save half a minute)
import tempfile

with tempfile.TemporaryDirectory() as tmp:
    log = run(f"make --no-print-directory elastic-restart ELASTIC={tmp}/elastic FAIL_AT=20 "
              "ARGS='--dataset mnist-standin --epochs 2 --max-steps 15'", quiet=True)
keep = ("---", "torchrun gave", "resumed from", "final:", "bitwise identical")
for line in log.splitlines():
    if line.startswith(keep) or "bitwise identical" in line:
        print(line)
assert "restart 1" in log and "bitwise identical: True" in log

# %% [markdown]
# The second run's first attempt died in epoch 2 (its traceback goes to standard error, which `nbhelpers.run`
# keeps for failures only). The restarted group found the checkpoint written after epoch 1, repeated epoch 2, and
# ended with the same weights as the run that never failed. The restart needs its own keys in torchrun's
# key-value store to be reliable on Gloo: `workarounds.join_group_per_attempt`, explained in the README.
