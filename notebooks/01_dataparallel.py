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
# # 01 · The baseline and DataParallel
#
# `nn.DataParallel` is one process that copies the model to every GPU on each forward pass, cuts the batch along
# dimension 0, runs the pieces in threads and gathers the outputs on one GPU. In the course it is a side branch of
# the single-process baseline; the main line goes on to DDP. The [section README](../01_dataparallel/README.md)
# explains the design and its costs.

# %% [markdown]
# ## How a batch is split
#
# `dataparallel_shapes.py` feeds 100 random samples in batches of 30 to a model that prints the shape it receives.
# On two GPUs each batch of 30 becomes two pieces of 15, and the last batch of 10 two pieces of 5. With fewer than
# two GPUs the script prints the split it *would* make (`torch.chunk`), and the model runs on the whole batch.

# %% tags=["nbval-ignore-output"]
from nbhelpers import final, records, run, show

out = run("python 01_dataparallel/dataparallel_shapes.py --gpus 2")

# %% tags=["check"] jupyter={"source_hidden": true}
# the notebook's own checks (make test runs them; collapsed in Jupyter)
assert out.count("input size [15, 5]") == 6 and out.count("input size [5, 5]") == 2
assert "Outside: input size [10, 5] output size [10, 2]" in out

# %% [markdown]
# ## What DataParallel changes in the baseline
#
# The lines marked `# DP:` are the whole change: wrap the model, put the labels where the outputs are gathered,
# and save the inner module's weights (`net`, which the wrapper holds as `model.module`), whose keys carry no
# `module.` prefix. Without a usable GPU there is nothing to split, and the plain `net` trains.

# %%
show("01_dataparallel/mnist_dataparallel.py", marked="DP:")

# %% [markdown]
# ## Training with DataParallel
#
# The same short run twice: the baseline and the DataParallel version. Without a GPU, the DataParallel version
# trains the plain model, so the two print exactly the same losses.

# %% tags=["nbval-ignore-output"]
args = "--dataset mnist-standin --epochs 1 --max-steps 40 --log-every 10"
single = run(f"python 01_dataparallel/mnist_single.py {args}", quiet=True)
dp = run(f"python 01_dataparallel/mnist_dataparallel.py {args}", quiet=True)
print("baseline:    ", [s["loss"] for s in records(single, "step")])
print("DataParallel:", [s["loss"] for s in records(dp, "step")])

# %% tags=["check"] jupyter={"source_hidden": true}
# the notebook's own checks (make test runs them; collapsed in Jupyter)
import common

if common.usable_gpus() == 0:
    assert records(single, "step") == records(dp, "step"), "without a GPU, DataParallel changes no number"
else:
    assert "nn.DataParallel over GPUs" in dp
assert final(dp)["test_samples"] == 4000

# %% [markdown]
# On GPUs the numbers can differ a little: the batch is split, and float sums over pieces round differently.
# Next: [02_ddp_spawn.ipynb](02_ddp_spawn.ipynb), where each device gets its own process.
