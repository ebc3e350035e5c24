"""Write the course notebooks from the cell lists below, then execute them so they keep their outputs.

    python tools/build_notebooks.py                 # all notebooks
    python tools/build_notebooks.py 02_ddp_spawn    # one

Edit the cells here, rebuild, and commit the .ipynb files: they carry their outputs so that they
render when read online, and `make notebooks` (nbval) re-runs them and compares.

Rules for cells: multi-process work runs through nbhelpers.run (a failing command fails the cell),
never `!cmd` and never mp.spawn of a function defined in a cell. Output that depends on the machine
(device, timings, process order) goes in a `# NBVAL_IGNORE_OUTPUT` cell that asserts what must hold.
"""

import subprocess
import sys
from pathlib import Path

import nbformat as nbf

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
md, code = nbf.v4.new_markdown_cell, nbf.v4.new_code_cell

OVERVIEW = [
    md("""# Overview: data-parallel training with PyTorch, one runnable step at a time

This course takes one small training script (a ConvNet on MNIST) and turns it, a step at a time, into a
job that runs on several processes, several machines, and in mixed precision. Every step is a script you can run
on a laptop CPU (Gloo backend) and unchanged on GPUs (NCCL backend). Each notebook runs its section's scripts
and shows what they print.

| step | folder | what it adds | make target |
|---|---|---|---|
| 1 | `01_dataparallel` | the single-process baseline, then `nn.DataParallel` (one process, many GPUs) | `make smoke`, `make dataparallel` |
| 2 | `02_ddp_spawn` | `DistributedDataParallel`, one process per device, started by `mp.spawn` | `make ddp-spawn NPROC=2` |
| 3 | `03_ddp_torchrun` | the same started by `torchrun` (`env://`), elastic restarts | `make ddp-torchrun NPROC=2` |
| 4 | `04_multinode_tcp` | `tcp://` and `file://` initialisation, several nodes, Slurm | `make multinode-tcp NNODES=2` |
| 5 | `05_collectives` | send/recv and the collectives by hand, exact distributed evaluation | `make collectives NPROC=4` |
| 6 | `06_amp_syncbn` | mixed precision (autocast, GradScaler) and SyncBatchNorm, CIFAR-10 ResNet-18 | `make amp-syncbn NPROC=2` |
| 7 | `bench` | the seeds' claims measured: DP vs DDP, DDP's cost, all-reduce bandwidth, AMP, bucket sizes | `make bench` |
"""),
    md("""## DataParallel or DistributedDataParallel?

| | `nn.DataParallel` (DP) | `DistributedDataParallel` (DDP) |
|---|---|---|
| processes | one, with one thread per GPU | one per GPU (or per CPU share) |
| machines | one | one or many |
| model copies | re-copied to every GPU on **every** forward | copied once, at construction |
| gradients | summed onto the first GPU | averaged by all-reduce, overlapped with backward |
| memory | the first GPU holds outputs and loss: uneven | even |
| Python GIL | shared by all GPUs' threads | one interpreter per process |
| code change | one line | process group, sampler, launcher |

PyTorch recommends DDP even on a single machine: it is faster and scales past one node. DP stays useful as a
one-line experiment, and it is the first step of the course because the difference teaches what DDP fixes.
"""),
    md("""## What runs where

The scripts pick the device and the communication backend themselves: CUDA + NCCL when there is one GPU for
every process, otherwise CPU + Gloo. `--device` and `--backend` override the choice. On this machine:"""),
    code("""# NBVAL_IGNORE_OUTPUT
import torch

import common

for nproc in (1, 2):
    device, backend = common.choose_device(procs_per_node=nproc)
    print(f"{nproc} process(es) per node -> device={device.type} backend={backend}")
print("CUDA GPUs visible:", torch.cuda.device_count())"""),
    md("""## The baseline, run from here

Notebooks start the course's scripts as subprocesses (`nbhelpers.run`), so a failing run fails its cell. The
data set is the offline MNIST stand-in: generated, learnable handwriting-like digits stored in MNIST's own file
format, so that `torchvision.datasets.MNIST` reads it. With internet, `make data` fetches the real MNIST and
`--dataset auto` (the default) uses it."""),
    code("""import common
from nbhelpers import REPO, final, run

common.prepare_data("mnist-standin", REPO / "data", quiet=True)  # about a second, once
out = run("python 01_dataparallel/mnist_single.py --dataset mnist-standin --epochs 1 --max-steps 60")
summary = final(out)
assert summary["world_size"] == "1" and summary["test_samples"] == "4000"
"""),
    md("""Every training script ends with a `final:` line in the same format, which the tests read. After only
60 steps the accuracy is already well above chance; `make smoke` runs the whole epoch.

Next: [01_dataparallel.ipynb](01_dataparallel.ipynb), [02_ddp_spawn.ipynb](02_ddp_spawn.ipynb),
[03_ddp_torchrun.ipynb](03_ddp_torchrun.ipynb), [04_multinode_tcp.ipynb](04_multinode_tcp.ipynb),
[05_collectives.ipynb](05_collectives.ipynb),
[06_amp_syncbn.ipynb](06_amp_syncbn.ipynb)."""),
]

DATAPARALLEL = [
    md("""# 01 · DataParallel

`nn.DataParallel` is one process that copies the model to every GPU on each forward pass, cuts the batch along
dimension 0, runs the pieces in threads and gathers the outputs on one GPU. This notebook runs the section's
scripts; the [section README](../01_dataparallel/README.md) explains the design and its costs."""),
    md("""## How a batch is split

`dataparallel_shapes.py` feeds 100 random samples in batches of 30 to a model that prints the shape it receives.
On two GPUs each batch of 30 becomes two pieces of 15, and the last batch of 10 two pieces of 5. Without GPUs the
script prints the split it *would* make, and DataParallel just calls the model on the whole batch."""),
    code("""# NBVAL_IGNORE_OUTPUT
from nbhelpers import final, run

out = run("python 01_dataparallel/dataparallel_shapes.py --gpus 2")
assert out.count("input size [15, 5]") == 6 and out.count("input size [5, 5]") == 2
assert "Outside: input size [10, 5] output size [10, 2]" in out"""),
    md("""## Training with DataParallel

The same short run twice: the plain baseline and the DataParallel version. On a CPU machine DataParallel calls
the model directly, so the two must print exactly the same losses: the wrapper changes nothing but the keys of
the state dict (`module.` prefix), which is why the script saves `model.module.state_dict()`."""),
    code("""# NBVAL_IGNORE_OUTPUT
common_args = "--dataset mnist-standin --epochs 1 --max-steps 100 --log-every 25"
single = run(f"python 01_dataparallel/mnist_single.py {common_args}")
print()
dp = run(f"python 01_dataparallel/mnist_dataparallel.py {common_args}")"""),
    code("""# NBVAL_IGNORE_OUTPUT
import torch


def losses(output):
    return [line.split("loss=")[1] for line in output.splitlines() if " step " in line]


print("baseline:    ", losses(single))
print("DataParallel:", losses(dp))
if not torch.cuda.is_available():
    assert losses(single) == losses(dp), "without a GPU, DataParallel must not change the numbers"
else:
    assert "nn.DataParallel over GPUs" in dp
assert final(dp)["test_samples"] == "4000\""""),
    md("""On GPUs the numbers differ a little: the batch is split, and float sums over pieces round differently.
Next: [02_ddp_spawn.ipynb](02_ddp_spawn.ipynb), where each device gets its own process."""),
]

SPAWN = [
    md("""# 02 · DDP started with mp.spawn

One process per device; DDP averages gradients with an all-reduce during backward. The notebook runs the scripts
as subprocesses: `mp.spawn` cannot start a function defined in a notebook cell (the child processes import the
main module to find it, and a notebook has none they can import). See the
[section README](../02_ddp_spawn/README.md) for how it all works."""),
    md("""## The toy demo: different data, identical weights

Each rank feeds different random data through `DDP(ToyModel)` for one step; afterwards all ranks hold exactly the
same weights, because the gradients were averaged."""),
    code("""# NBVAL_IGNORE_OUTPUT
from nbhelpers import final, run

out = run("python 02_ddp_spawn/ddp_basics.py basic --nproc 2")
assert "all 2 ranks hold the same weights: True" in out"""),
    md("""## DDP equals one big batch

`ddp_equivalence.py` trains N ranks with 32 samples each and compares with one process on all N×32 samples.
Without BatchNorm the weights agree to float rounding; with BatchNorm they do not (each rank normalises with its
own slice's statistics) unless the single-process reference also runs BatchNorm per slice."""),
    code("""# NBVAL_IGNORE_OUTPUT
out = run("python 02_ddp_spawn/ddp_equivalence.py --nproc 2")
assert "gradients_averaged=True" in out"""),
    md("""## MNIST on 1 and 2 processes

The same short run with `--nproc 1` and `--nproc 2`. Each process takes batches of 64, so 2 processes take 128
samples per step and need half the steps per epoch. The loss is logged every 5 steps on rank 0."""),
    code("""args = "--dataset mnist-standin --epochs 1 --max-steps 90 --log-every 5"
runs = {n: run(f"python 02_ddp_spawn/mnist_spawn.py --nproc {n} {args}", quiet=True) for n in (1, 2)}
for n, out in runs.items():
    print(f"{n} process(es):", out.strip().splitlines()[-1])
    assert final(out)["world_size"] == str(n) and final(out)["test_samples"] == "4000\""""),
    code("""# NBVAL_IGNORE_OUTPUT
import matplotlib.pyplot as plt


def curve(out):
    points = [line.split() for line in out.splitlines() if " step " in line]
    steps = [int(p[3].split("/")[0]) for p in points]
    return steps, [float(p[4].split("=")[1]) for p in points]


fig, (by_step, by_sample) = plt.subplots(1, 2, figsize=(10, 3.5), sharey=True)
for n, out in runs.items():
    steps, loss = curve(out)
    by_step.plot(steps, loss, label=f"{n} process(es)")
    by_sample.plot([s * 64 * n for s in steps], loss, label=f"{n} process(es)")
by_step.set(xlabel="optimizer step", ylabel="training loss (rank 0)", title="per step")
by_sample.set(xlabel="samples seen (all ranks)", title="per sample")
by_step.legend()
plt.tight_layout()
plt.show()"""),
    md("""Per step, two processes learn faster: each step averages the gradients of 128 samples instead of 64.
Per sample seen, the curves are close: with the same learning rate, a bigger global batch makes fewer, better
averaged steps. (Scaling the learning rate with the number of processes is a common rule of thumb; the course
keeps it fixed so that the runs are directly comparable.)

Next: [03_ddp_torchrun.ipynb](03_ddp_torchrun.ipynb) starts the same training with `torchrun`."""),
]

TORCHRUN = [
    md("""# 03 · DDP started with torchrun

`torchrun` starts the processes from outside the script and passes each its rank through environment variables
(`env://`). The [section README](../03_ddp_torchrun/README.md) lists them and explains the options. This notebook
runs the headline command, plots the accuracy per epoch, and then runs the elastic failure demo."""),
    md("""## The headline run

`make ddp-torchrun NPROC=2`: two processes, CPU + Gloo here, one GPU each + NCCL on a GPU machine. Three epochs
this time, to have a curve to draw."""),
    code("""from nbhelpers import final, run

out = run("make --no-print-directory ddp-torchrun NPROC=2 EPOCHS=3 DATASET=mnist-standin")
summary = final(out)
assert summary["world_size"] == "2" and summary["test_samples"] == "4000"
"""),
    code("""# NBVAL_IGNORE_OUTPUT
import matplotlib.pyplot as plt

epochs = [line for line in out.splitlines() if line.startswith("epoch ") and "test_acc=" in line]
acc = [float(line.split("test_acc=")[1]) for line in epochs]
plt.figure(figsize=(5, 3))
plt.plot(range(1, len(acc) + 1), acc, marker="o")
plt.xticks(range(1, len(acc) + 1))
plt.xlabel("epoch")
plt.ylabel("test accuracy (all 4000 images)")
plt.title("mnist_torchrun.py, 2 processes")
plt.tight_layout()
plt.show()
assert acc[-1] > 0.97"""),
    md("""## A worker fails; torchrun restarts the group; training resumes

`make ddp-elastic` runs the training twice on short epochs: uninterrupted, and with `--max-restarts 1` while
rank 1 raises at step 20 on the first attempt. The lines below are picked from its log: the failure, the restart
(`restart 1`), the resume from the epoch-1 checkpoint, and the comparison of the final weights."""),
    code("""import tempfile

with tempfile.TemporaryDirectory() as tmp:
    log = run(f"make --no-print-directory ddp-elastic ELASTIC={tmp}/elastic FAIL_AT=20 "
              "ARGS='--dataset mnist-standin --epochs 2 --max-steps 15'", quiet=True)
keep = ("---", "torchrun gave", "resumed from", "final:", "bitwise identical")
for line in log.splitlines():
    if any(word in line for word in keep):
        print(line)
assert "restart 1" in log and "bitwise identical: True" in log"""),
    md("""The second run's first attempt died in epoch 2 (its traceback goes to standard error, which
`nbhelpers.run` keeps for failures only). The restarted group found the checkpoint written after epoch 1,
repeated epoch 2, and ended with the same weights as the run that never failed. The README explains why the
restart needs its own namespace in torchrun's key-value store to be reliable on Gloo."""),
]

MULTINODE = [
    md("""# 04 · Several nodes, every process started by hand

With `tcp://` initialisation each process is told rank 0's address, the world size and its own place in the job.
This notebook runs 2 simulated nodes x 2 processes on this machine (`make multinode-tcp`) and checks the rank
arithmetic of every process. The [section README](../04_multinode_tcp/README.md) covers the init methods,
torchrun on several nodes, network namespaces, Slurm, and the "works on one node, not on two" checklist."""),
    md("""## The rank arithmetic

`world_size = nodes x processes per node`, `rank = node_rank x nproc_per_node + local_rank`, and each process
uses GPU `local_rank` of its own machine."""),
    code("""nnodes, nproc = 2, 2
world_size = nnodes * nproc
print(f"world_size = {nnodes} x {nproc} = {world_size}")
for node_rank in range(nnodes):
    for local_rank in range(nproc):
        rank = node_rank * nproc + local_rank
        print(f"node {node_rank}, local rank {local_rank}: rank = {node_rank} x {nproc} + {local_rank} = {rank}"
              f", device cuda:{local_rank} (or the CPU)")"""),
    md("""## The simulation

`launch_local.sh` starts the four processes with `--node-rank` and `--local-rank`; each reports the rank it
computed once it has joined. The lines arrive in any order; sorted by rank they must match the table."""),
    code("""import re

from nbhelpers import final, run

out = run("make --no-print-directory multinode-tcp NNODES=2 NPROC=2 EPOCHS=1 DATASET=mnist-standin "
          "ARGS='--max-steps 40'", quiet=True)
joined = sorted((int(r), int(n), int(l)) for r, n, l in
                re.findall(r"rank (\\d+) \\(node (\\d+), local rank (\\d+)\\) of 4 joined via tcp", out))
for rank, node, local in joined:
    print(f"rank {rank}: node {node}, local rank {local}, check {node} x 2 + {local} = {node * 2 + local}")
    assert rank == node * 2 + local
assert [r for r, _, _ in joined] == [0, 1, 2, 3]
print(out.strip().splitlines()[-2])  # the final: line
assert final(out)["world_size"] == "4" and final(out)["test_samples"] == "4000"
"""),
    md("""On real machines the only differences are the address in `--init-method` (node 0's, reachable from every
node) and that each pair of commands runs on its own machine. `make multinode-file` does the same through a new
file instead of an address; `sudo make multinode-netns` runs the two nodes in two network namespaces, each with
its own interface and address."""),
]

COLLECTIVES = [
    md("""# 05 · Collectives, with 4 processes

`collectives.py` runs every collective on small tensors and prints, per rank, the value before and after. Here it
runs with 4 processes; the tables for `all_reduce` and `reduce_scatter` are drawn as bars. The
[section README](../05_collectives/README.md) explains each op, the backends, and the evaluation and hang lessons."""),
    code("""import re

from nbhelpers import run

out = run("make --no-print-directory collectives NPROC=4 BACKEND=gloo", quiet=True)  # Gloo: CPU tensors
assert "result: all collectives correct" in out


def block(title):
    \"\"\"The rows of one op's table: [(before, after), ...] per rank, as printed.\"\"\"
    lines = out.split(title, 1)[1].splitlines()[1:5]
    return [tuple(eval(part) for part in re.match(r"\\s+rank \\d: (.+?)\\s+-> (.+)", ln).groups()) for ln in lines]


for title in ("all_reduce(SUM, float32)", "reduce_scatter(SUM)", "all_to_all_single"):
    print(title)
    for rank, (before, after) in enumerate(block(title)):
        print(f"    rank {rank}: {before} -> {after}")"""),
    code("""# NBVAL_IGNORE_OUTPUT
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
im = axes[1].imshow(before, cmap="Blues")
for r, row in enumerate(before):
    for j, v in enumerate(row):
        axes[1].text(j, r, f"{v:g}", ha="center", va="center")
for j in ranks:  # what rank j holds afterwards: the sum of column j
    axes[1].text(j, len(ranks) - 0.1, f"{rs[j][1][0]:g}", ha="center", va="top", color="darkred")
axes[1].set(title="reduce_scatter: rank j gets column j's sum (red)", xlabel="piece j = rank j", ylabel="rank r",
            xticks=list(ranks), yticks=list(ranks), ylim=(len(ranks) + 0.4, -0.5))
plt.tight_layout()
plt.show()"""),
    md("""## Exact evaluation

A padded `DistributedSampler` counts some test images twice; strided shards and one `reduce` give exactly the
single-process numbers."""),
    code("""# NBVAL_IGNORE_OUTPUT
out = run("make --no-print-directory ddp-eval NPROC=3 ARGS='--subset 10'")
assert "padded_count=12 exact_count=10 exact_equals_single=True" in out"""),
]

AMP = [
    md("""# 06 · Mixed precision and SyncBatchNorm

Two short runs of `mnist_amp_syncbn.py` with 2 processes, full precision and bf16 (on a GPU: fp16 with a
GradScaler), with their training losses side by side; then what BatchNorm sees on each rank versus what
SyncBatchNorm computes. The [section README](../06_amp_syncbn/README.md) explains both."""),
    code("""from nbhelpers import final, run

args = "--dataset mnist-standin --epochs 1 --max-steps 120 --log-every 10 --sync-bn"
runs = {amp: run(f"make --no-print-directory amp-syncbn NPROC=2 ARGS='{args} --amp {amp}'", quiet=True)
        for amp in ("off", "auto")}
for amp, out in runs.items():
    print(amp, "->", out.strip().splitlines()[-1])
    assert final(out)["test_samples"] == "4000"
"""),
    code("""# NBVAL_IGNORE_OUTPUT
import matplotlib.pyplot as plt

plt.figure(figsize=(6, 3.2))
for amp, out in runs.items():
    points = [line.split() for line in out.splitlines() if " step " in line]
    label = "fp32" if amp == "off" else f"mixed ({final(out)['amp']})"
    plt.plot([int(p[3].split("/")[0]) for p in points], [float(p[4].split("=")[1]) for p in points], label=label)
plt.xlabel("step")
plt.ylabel("training loss (rank 0)")
plt.legend()
plt.tight_layout()
plt.show()
accs = [float(final(out)["test_acc"]) for out in runs.values()]
assert abs(accs[0] - accs[1]) < 0.02"""),
    md("""## What BatchNorm sees on each rank

A batch of 8 images split over 2 ranks: plain BatchNorm normalises each half with its own mean and variance;
SyncBatchNorm (and `AllReduceBatchNorm2d` on CPUs) uses the statistics of all 8. The numbers below are one
channel's statistics, computed directly."""),
    code("""import torch

g = torch.Generator().manual_seed(0)
batch = torch.randn(8, 1, 4, 4, generator=g) * 2 + 1
batch[4:] += 1.5  # the second rank's images happen to be brighter
halves = batch.chunk(2)
print(f"{'':<24}{'mean':>8}{'variance':>10}")
for r, half in enumerate(halves):
    print(f"{'BatchNorm on rank ' + str(r):<24}{half.mean():>8.3f}{half.var(unbiased=False):>10.3f}")
print(f"{'SyncBatchNorm (all 8)':<24}{batch.mean():>8.3f}{batch.var(unbiased=False):>10.3f}")"""),
    code("""# NBVAL_IGNORE_OUTPUT
out = run("make --no-print-directory syncbn-proof NPROC=2")
assert "equal=True" in out"""),
]

BENCHMARKS = [
    md("""# 07 · Benchmarks: what the seeds claim, measured

The seeds say DDP is faster than DataParallel, that collectives beat point-to-point sends, that mixed precision
pays. `make bench` measures each claim on your machine (about 5 minutes on 2 CPU cores) and writes JSON, a
markdown table and a plot per benchmark into `bench/results/`, named by benchmark, backend, machine and date.
This notebook reads the newest full results there and shows them; [bench/README.md](../bench/README.md) reads the
recorded ones for you.

Every benchmark runs each variant once per round, in a rotating order, and computes ratios inside a round: a noisy
moment of the machine then hits all variants alike. Numbers are medians over the rounds, with the range
(min-max). After `make bench` on your own machine, run this notebook again to see yours."""),
    code("""import json
from pathlib import Path

from IPython.display import Image, Markdown, display

RESULTS = Path("../bench/results")


def newest(bench):
    \"\"\"The newest full (not --quick) result of one benchmark, by the date it was measured.\"\"\"
    runs = [json.loads(p.read_text()) | {"_path": p} for p in RESULTS.glob(f"{bench}_*.json")]
    runs = [r for r in runs if not r.get("quick")]
    assert runs, f"no {bench} results in {RESULTS}: run make bench"
    return max(runs, key=lambda r: r["machine"]["date"])


def show(run):
    print("from", run["_path"].name)
    display(Markdown(run["_path"].with_suffix(".md").read_text()))
    display(Image(filename=str(run["_path"].with_suffix(".png"))))


results = {b: newest(b) for b in ("throughput", "amp", "buckets", "allreduce_sweep")}"""),
    md("""## 1-2 · Throughput: DataParallel, DDP, launchers, and the data path

The seed's ConvNet on MNIST-shaped data. *plain* is the bare loop with the batches already on the device; the
course's data path and torchvision's per-image loader show what feeding the model costs; DataParallel and DDP at
world size 1 show what the wrappers cost; `mp.spawn` and `torchrun` at world size 2 show what a second process
brings. *One worker's share* is DDP at world size 1 on half of the cores: the baseline for scaling efficiency."""),
    code("""# NBVAL_IGNORE_OUTPUT
run = results["throughput"]
show(run)
ratios = run["ratios"]
print(f"DDP overhead at world size 1: {ratios['ddp_ws1_overhead']['median']:+.1%}")
for key in (k for k in ratios if k.startswith(("speedup", "efficiency"))):
    print(f"{ratios[key]['meaning']}: {ratios[key]['median']:.2f}")
assert {"plain", "course", "dataparallel", "ddp_ws1"} <= set(run["results"])"""),
    md("""## 3-4 · Collective bandwidth, and a ring of sends against all_reduce

Latency, algorithm bandwidth and bus bandwidth (nccl-tests' definitions) from 4 KB to 256 MB, with one
process's memory copy bandwidth as the dashed limit. `ring_p2p` is an all_reduce built from `isend`/`irecv`
around a ring: the same bytes, moved by hand."""),
    code("""# NBVAL_IGNORE_OUTPUT
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
assert all(r["busbw_GBps"] > 0 for r in run["rows"])"""),
    md("""## 5 · Mixed precision

fp32 against bf16 autocast (and fp16 with a GradScaler on CUDA) for the ConvNet and ResNet-18, one process.
Whether bf16 pays on a CPU depends on its instructions (`avx512_bf16`, `amx_bf16`): the JSON lists them."""),
    code("""# NBVAL_IGNORE_OUTPUT
run = results["amp"]
show(run)
print("CPU features:", run["machine"]["cpu_flags"])
assert all(v > 0 for v in (s["median"] for s in run["results"].values()))"""),
    md("""## 6 · DDP's bucket size

ResNet-18 under DDP with 2 processes, `bucket_cap_mb` from 1 to 100 MB, and `no_sync` (no communication at
all) as the ceiling."""),
    code("""# NBVAL_IGNORE_OUTPUT
run = results["buckets"]
show(run)
assert run["buckets"]["1 MB"] > run["buckets"]["100 MB"]"""),
]

ALL = {"00_overview": OVERVIEW, "01_dataparallel": DATAPARALLEL, "02_ddp_spawn": SPAWN,
       "03_ddp_torchrun": TORCHRUN, "04_multinode_tcp": MULTINODE,
       "05_collectives": COLLECTIVES, "06_amp_syncbn": AMP, "07_benchmarks": BENCHMARKS}


def build(name: str) -> None:
    nb = nbf.v4.new_notebook()
    nb.cells = ALL[name]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = NOTEBOOKS / f"{name}.ipynb"
    nbf.write(nb, path)
    subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute", "--inplace",
                    "--log-level", "WARN", path.name], cwd=NOTEBOOKS, check=True)
    print(f"built {path.relative_to(NOTEBOOKS.parent)}")


if __name__ == "__main__":
    for name in sys.argv[1:] or ALL:
        build(name)
