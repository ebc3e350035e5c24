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
# # 07 · Beyond DDP: FSDP2, ZeRO, torch.compile, uneven inputs
#
# What `mnist_fsdp2.py` changes in the torchrun step, a run saved by 2 ranks and continued by 3, what each rank
# holds, the memory of DDP, ZeRO and FSDP2 per rank, and the uneven-inputs demo. The
# [section README](../07_beyond_ddp/README.md) explains each.

# %% [markdown]
# ## Sharding the model
#
# Every block first, then the root; the optimizer is built over the shards:

# %%
from nbhelpers import final, run, show

show("07_beyond_ddp/mnist_fsdp2.py", marked="FSDP:")

# %% [markdown]
# ## Saved by 2 ranks, continued by 3
#
# One epoch with 2 processes writes the sharded checkpoint and the full weights into one folder; 3 processes then
# continue it.

# %% tags=["nbval-skip"]
import tempfile

ck = tempfile.mkdtemp()
args = f"--dataset mnist-standin --max-steps 60 --checkpoint-dir {ck}"
two = run(f"make --no-print-directory fsdp NPROC=2 EPOCHS=1 ARGS='{args}'", quiet=True)
three = run(f"make --no-print-directory fsdp NPROC=3 EPOCHS=2 ARGS='{args}'", quiet=True)
for out in (two, three):
    print("\n".join(line for line in out.splitlines() if line.startswith(("resumed", "epoch", "final"))))

# %% [markdown]
# What each of the 3 ranks wrote: the rows of dimension 0 of every parameter, about 1/3 each.

# %% tags=["nbval-skip"]
import torch.distributed.checkpoint as dcp

meta = dcp.FileSystemReader(f"{ck}/mnist_fsdp2").read_metadata()
files = {(i.fqn, tuple(i.offset)): info.relative_path for i, info in meta.storage_data.items() if i.offset is not None}
for key, m in meta.state_dict_metadata.items():
    if key.startswith("model.") and key.endswith("weight"):
        parts = ", ".join(f"{files[(key, tuple(c.offsets))]}: {c.sizes[0]}" for c in m.chunks)
        print(f"{key:24} {tuple(m.size)!s:18} rows per file: {parts}")

# %% [markdown]
# The full weights of the same epoch, `model.pt` in that folder, are a plain `ConvNet` state_dict:

# %% tags=["nbval-skip"]
from pathlib import Path

import torch

import common

model = common.ConvNet()
print(sorted(p.name for p in Path(ck).iterdir()), sorted(p.name for p in Path(ck, "mnist_fsdp2").iterdir()))
print(model.load_state_dict(torch.load(f"{ck}/mnist_fsdp2/model.pt", weights_only=True), strict=True))

# %% tags=["nbval-skip", "check"] jupyter={"source_hidden": true}
# the notebook's own checks (collapsed in Jupyter)
assert final(two)["world_size"] == 2 and final(three)["world_size"] == 3
assert "resumed from" in three and "after epoch 1" in three
assert sorted(p.name for p in Path(ck).iterdir()) == ["mnist_fsdp2"]  # the swap left nothing beside it

# %% [markdown]
# ## Memory per rank: DDP, ZeRO, FSDP2
#
# The recorded `make bench-memory`: tensor bytes after one step, the largest rank, in MiB. Parameters, gradients
# and Adam's state, then the communication buffer (DDP's gradient buckets; FSDP2's largest gathered unit), and the
# sum of both as a fraction of DDP's:

# %%
import json
from pathlib import Path

record = json.loads(Path("../bench/results/memory_gloo_cpu2_2026-11-28.json").read_text())
print(f"{'model/method':16}{'N':>3}{'params':>9}{'grads':>8}{'Adam':>8}{'total':>9}{'buffer':>8}{'vs DDP':>8}")
for key, by_ws in record["mib"].items():
    for ws, row in by_ws.items():
        print(f"{key:16}{ws:>3}{row['params']:>9.2f}{row['grads']:>8.2f}{row['optimizer']:>8.2f}"
              f"{row['total']:>9.2f}{row['buffer']:>8.2f}{row['with_buffer_vs_ddp']:>8.2f}")

# %% [markdown]
# ## Uneven inputs
#
# Rank r holds 4 + r batches. Without `Join` the job fails after its 5 s timeout; with `Join` it finishes.

# %% tags=["nbval-skip"]
out = run(["bash", "-c", "make --no-print-directory uneven NPROC=2 2>&1"], quiet=True)  # the errors too
shown = [line.strip() for line in out.splitlines() if line.startswith(("--- ", "rank 0", "final"))
         or line.strip().startswith("RuntimeError: [Rank 0]")]
print("\n".join(dict.fromkeys(shown)))  # each line once
