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
# # 04 · Several nodes, every process started by hand
#
# With `tcp://` initialisation each process is told rank 0's address, the world size and its own place in the job.
# This notebook runs 2 simulated nodes x 2 processes on this machine (`make multinode-tcp`) and checks the rank
# arithmetic of every process. The [section README](../04_multinode_tcp/README.md) covers the init methods,
# torchrun on several nodes, network namespaces, Slurm, and the "works on one node, not on two" checklist.

# %% [markdown]
# ## The rank arithmetic
#
# `world_size = nodes x processes per node`, `rank = node_rank x nproc_per_node + local_rank`, and each process
# uses GPU `local_rank` of its own machine. In the script:

# %%
from nbhelpers import final, run, show

show("04_multinode_tcp/mnist_tcp.py", "global_rank")

# %% [markdown]
# ## The simulation
#
# `launch_local.sh` starts the four processes with `--node-rank` and `--local-rank` and prints each command; each
# process reports the rank it computed once it has joined. The lines arrive in any order; sorted by rank they must
# match the arithmetic. `run(..., trace=DIR)` also records, from outside the processes, what each rank trains on:
# the four shards must cover the training set once, and all ranks must end with the same weights.

# %% tags=["nbval-skip"]
import re
import tempfile

from nbhelpers import checks, shards

trace = tempfile.mkdtemp()
out = run("make --no-print-directory multinode-tcp NNODES=2 NPROC=2 EPOCHS=1 DATASET=mnist-standin "
          "ARGS='--max-steps 40'", quiet=True, trace=trace)
started = {(int(n), int(lr)) for n, lr in re.findall(r"--node-rank (\d+) --local-rank (\d+)", out)}
joined = sorted((int(r), int(lr)) for r, lr in re.findall(r"rank (\d+) \(local rank (\d+)\) of 4 joined via tcp", out))
samples = {row["rank"]: row["samples"] for row in shards(trace)}
for rank, local in joined:
    node = next(n for n, lr in started if lr == local and n * 2 + lr == rank)  # the command that made this rank
    print(f"rank {rank}: started as node {node}, local rank {local}: {node} x 2 + {local} = {node * 2 + local}; "
          f"trains on {samples[rank]} samples")
summary = final(out)
print(f"final: world_size={summary['world_size']} test_samples={summary['test_samples']}")

# %% tags=["nbval-skip", "check"] jupyter={"source_hidden": true}
# the notebook's own checks (make test runs them; collapsed in Jupyter)
assert [r for r, _ in joined] == [0, 1, 2, 3] and len(started) == 4 and sum(samples.values()) == 24000
verdicts = checks(trace)
assert summary["world_size"] == 4 and summary["test_samples"] == 4000
assert verdicts["shards"][0] == "ok" and verdicts["ddp"][0] == "ok" and verdicts["buffers"][0] == "ok"

# %% [markdown]
# On real machines the only differences are the address in `--init-method` (node 0's, reachable from every
# node) and that each pair of commands runs on its own machine. `make multinode-file` does the same through a new
# file instead of an address; `sudo make multinode-netns` runs the two nodes in two network namespaces, each with
# its own interface and address.
