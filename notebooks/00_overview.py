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
# # Overview: data-parallel training with PyTorch, one runnable step at a time
#
# This course takes one small training script (a ConvNet on MNIST) and turns it, a step at a time, into a job
# that runs on several processes, several machines, and in mixed precision. Every step is a script you can run on
# a laptop CPU (Gloo backend) and unchanged on GPUs (NCCL backend). Each notebook runs its section's scripts,
# shows the lines of them that matter, and what they print.
#
# | notebook | folder | what it adds | make target |
# |---|---|---|---|
# | 01 | `01_dataparallel` | the single-process baseline; `nn.DataParallel` as a side branch | `make smoke`, `make dataparallel` |
# | 02 | `02_ddp_spawn` | `DistributedDataParallel`, one process per device, started by `mp.spawn` | `make ddp-spawn NPROC=2` |
# | 03 | `03_ddp_torchrun` | the same started by `torchrun`, elastic restarts | `make ddp-torchrun NPROC=2` |
# | 04 | `04_multinode_tcp` | `tcp://` and `file://` initialisation, several nodes, Slurm | `make multinode-tcp NNODES=2` |
# | 05 | `05_collectives` | send/recv and the collectives by hand, exact distributed evaluation | `make collectives NPROC=4` |
# | 06 | `06_amp_syncbn` | mixed precision (autocast, GradScaler) and SyncBatchNorm, CIFAR-10 ResNet-18 | `make amp-syncbn NPROC=2` |
# | 07 | `07_beyond_ddp` | what comes after DDP: FSDP2, ZeRO, `torch.compile`, uneven inputs with `Join` | `make fsdp NPROC=2` |
# | 08 | `bench` | the source notes' claims measured: DP vs DDP, DDP's cost, all-reduce bandwidth, AMP, buckets | `make bench` |
#
# In the scripts, every line about distribution carries a comment that starts with `# DDP:`; everything else is
# the same as in the single-process baseline.

# %% [markdown]
# ## DataParallel or DistributedDataParallel?
#
# | | `nn.DataParallel` (DP) | `DistributedDataParallel` (DDP) |
# |---|---|---|
# | processes | one, with one thread per GPU | one per GPU (or per CPU share) |
# | machines | one | one or many |
# | model copies | re-copied to every GPU on **every** forward | copied once, at construction |
# | gradients | summed onto the first GPU | averaged by all-reduce, overlapped with backward |
# | memory | the first GPU holds outputs and loss: uneven | even |
# | Python GIL | shared by all GPUs' threads | one interpreter per process |
# | code change | one line | process group, sampler, launcher |
#
# PyTorch recommends DDP even on a single machine: it is faster and scales past one node. DP stays useful as a
# one-line experiment, and the course shows it as a side branch of the baseline, because the difference teaches
# what DDP fixes.

# %% [markdown]
# ## What runs where
#
# The scripts pick the device and the communication backend themselves: CUDA + NCCL when there is one GPU for
# every process, otherwise CPU + Gloo. `--device` and `--backend` override the choice. On this machine:

# %% tags=["nbval-ignore-output"]
import common

for nproc in (1, 2):  # the call every script makes, with the defaults of --device auto --backend auto
    device, backend = common.device_and_backend(procs_per_node=nproc)
    print(f"{nproc} process(es) on this machine -> device={device.type} backend={backend}")

# %% [markdown]
# ## The baseline
#
# The training loop every later step keeps: data, model and optimizer, a checkpoint that a new run continues,
# one structured line per epoch, and a `final:` summary line.

# %%
from nbhelpers import final, records, run, show

show("01_dataparallel/mnist_single.py", "train")

# %% [markdown]
# Run from here. The data set is the offline MNIST stand-in: generated, learnable handwriting-like digits
# stored in MNIST's own file format, which `torchvision.datasets.MNIST` reads as well. With internet, `make data`
# fetches the real MNIST and `--dataset auto` (the default) uses it.

# %%
out = run("python 01_dataparallel/mnist_single.py --dataset mnist-standin --epochs 1 --max-steps 60")
summary = final(out)

# %% tags=["check"] jupyter={"source_hidden": true}
# the notebook's own checks (make test runs them; collapsed in Jupyter)
assert summary["world_size"] == 1 and summary["test_samples"] == 4000
assert records(out, "epoch")[0]["test_acc"] == summary["test_acc"]
assert summary["test_acc"] > 0.5  # ten classes: chance is 0.1

# %% [markdown]
# Every training script ends with a `final:` line in the same format: the test set's accuracy and size, the world
# size, the epochs, the seconds and the data set. After only 60 steps the accuracy is already well above chance; `make
# smoke` runs the whole epoch.
#
# Next: [01_dataparallel.ipynb](01_dataparallel.ipynb), [02_ddp_spawn.ipynb](02_ddp_spawn.ipynb),
# [03_ddp_torchrun.ipynb](03_ddp_torchrun.ipynb), [04_multinode_tcp.ipynb](04_multinode_tcp.ipynb),
# [05_collectives.ipynb](05_collectives.ipynb), [06_amp_syncbn.ipynb](06_amp_syncbn.ipynb),
# [07_beyond_ddp.ipynb](07_beyond_ddp.ipynb), [08_benchmarks.ipynb](08_benchmarks.ipynb).
