# The course's front door. `make help` lists every target.
#
# Variables: NPROC (processes per node; default: one per GPU, or 2 without GPUs), NNODES (nodes for the multinode
# targets, default 2), BACKEND (gloo|nccl, default auto),
# EPOCHS and DATASET (passed to the training scripts when set), ARGS (passed through as is),
# BENCH_OUT (where the benchmarks write, default runs/bench; bench/results holds the recorded ones).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
VENV_STAMP := $(VENV)/.installed
STAMP  := $(VENV_STAMP)
# `make test PY=python3`: an interpreter that already holds torch (a cluster module, a container, a machine without
# a package index) instead of the course's .venv; tools/check_torch.py says what it holds and refuses what cannot work
ifeq ($(origin PY),command line)
STAMP  := existing-python
endif
PYABS  := $(if $(findstring /,$(PY)),$(abspath $(PY)),$(PY))
# Every process make starts finds the course's modules (`import common`, `tools`), whatever the interpreter: torchrun's
# workers, mp.spawn's children, the launch scripts and a Slurm job are fresh interpreters that do not share the
# preflight's sys.path, and an interpreter of a cluster or a container has no editable install of the course.
space := $(subst ,, )
export PYTHONPATH := $(subst $(space),:,$(strip $(CURDIR) $(filter-out $(CURDIR),$(subst :, ,$(PYTHONPATH)))))
# every line reaches a log file or a pipe when it is printed: Python buffers its output when that is not a
# terminal, so `make ddp-torchrun > log` would otherwise show the epochs' lines only at the end
export PYTHONUNBUFFERED := 1

# GPUs this machine shows (nvidia-smi, narrowed by CUDA_VISIBLE_DEVICES when set): NPROC's default is one
# process per GPU, so that a GPU user's first run trains on the GPUs; 2 processes on a machine with fewer than 2,
# because the targets compare ranks (with one GPU they run on the CPU and say so, or share it: BACKEND=gloo
# ARGS=--device cuda)
GPUS    := $(shell if [ -n "$${CUDA_VISIBLE_DEVICES+set}" ]; then echo "$$CUDA_VISIBLE_DEVICES" | tr ',' '\n' \
             | grep -c .; else nvidia-smi -L 2>/dev/null | grep -c '^GPU'; fi)
NPROC_GIVEN := $(if $(filter command line environment,$(origin NPROC)),$(NPROC))
NPROC   ?= $(if $(filter-out 0 1,$(GPUS)),$(GPUS),2)
NNODES  ?= 2
BACKEND ?=
EPOCHS  ?=
DATASET ?=
ARGS    ?=

# flags for every training script; distributed ones also get the backend
TRAIN_ARGS := $(if $(EPOCHS),--epochs $(EPOCHS)) $(if $(DATASET),--dataset $(DATASET)) $(ARGS)
DIST_ARGS  := $(if $(BACKEND),--backend $(BACKEND)) $(TRAIN_ARGS)
# processes this machine runs at once (the multinode targets run every "node" here: NNODES x NPROC)
LOCAL_PROCS = $(NPROC)
comma := ,
# One process checks the arguments and prepares the data before torchrun starts NPROC of them, so that a mistake
# is one line instead of one error per process followed by torchrun's failure summary (tools/preflight.py). With
# --run, the command after it is printed and run in that same process once the checks pass: one start of Python
# and torch instead of two.
PREFLIGHT = $(PY) tools/preflight.py --nproc $(NPROC)

.DEFAULT_GOAL := help
.PHONY: help existing-python setup data smoke test test-fast notebooks diffs mutants lint clean distclean check-nproc \
        dataparallel dp-shapes ddp-basics ddp-equivalence ddp-spawn ddp-timeline \
        ddp-torchrun init-check ddp-minimal elastic-restart elastic-stress exit-stress free-stress launch-legacy \
        multinode-tcp multinode-file multinode-torchrun multinode-spawn multinode-netns check-nnodes \
        collectives p2p backend-matrix ddp-eval ddp-from-scratch hang-demo errors doctor \
        amp-syncbn syncbn-proof grad-accum cifar-resnet \
        fsdp zero compile uneven bench-memory \
        bench bench-quick bench-throughput bench-amp bench-buckets bench-allreduce bench-hooks bench-versions gpu-check \
        compat

help: ## list the targets
	@echo "usage: make TARGET [NPROC=$(NPROC)] [EPOCHS=..] [DATASET=auto|mnist|mnist-standin] [BACKEND=gloo|nccl] [ARGS='...']"
	@echo "NPROC defaults to one process per GPU ($(GPUS) visible), or 2 with fewer than 2 GPUs"
	@grep -hE '^[a-z0-9][a-z0-9-]*:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  %-18s %s\n", $$1, $$2}'

# ------------------------------------------------------------------ setup

# Which build of the pinned pair goes into .venv: where no NVIDIA GPU is visible (nvidia-smi lists none), PyTorch's
# CPU-only build from its own wheel index (about 1 GB instead of about 6: no NVIDIA libraries; the package index has
# no CPU-only torchvision that works), else the package index's CUDA build. CPU=1 or CPU=0 asks for one. Where the
# CPU index cannot be reached, one line says so and the CUDA build (which runs on a CPU as well) is installed
# instead. A failed install removes .venv: nothing is left half-installed.
NVIDIA := $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU')
CPU ?= $(if $(filter 0,$(NVIDIA)),1,0)
CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PIP_INSTALL = $(PY) -m pip install --quiet --disable-pip-version-check
PINS = $(shell grep -E '^torch(vision)?==' requirements.txt)
REACHABLE = $(PYTHON) -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=15)'

$(VENV_STAMP): requirements.txt requirements-dev.txt requirements-dev.lock pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "error: Python 3.10 or newer is needed, this is " + sys.version.split()[0])'
	@{ test -x $(PY) || $(PYTHON) -m venv $(VENV); } && \
	  if [ "$(CPU)" = 1 ] && $(REACHABLE) $(CPU_INDEX)/torch/ >/dev/null 2>&1; then \
	    echo "installing PyTorch's CPU-only build of $(PINS) (about 1 GB), then the dev tools, into $(VENV) ..."; \
	    $(PIP_INSTALL) --index-url $(CPU_INDEX) $(PINS); \
	  elif [ "$(CPU)" = 1 ]; then \
	    echo "note: PyTorch's CPU-only index ($(CPU_INDEX)) cannot be reached from here, so the CUDA build comes from the package index instead (about 6 GB; it runs on the CPU too). For the 1 GB build, make that index reachable (https_proxy=...) and run: make distclean setup"; \
	  else \
	    echo "installing the CUDA build of $(PINS) (about 6 GB; CPU=1: the CPU-only build), then the dev tools, into $(VENV) ..."; \
	  fi && \
	  $(PIP_INSTALL) -r requirements-dev.txt -c requirements-dev.lock && \
	  { $(PIP_INSTALL) --no-deps --no-build-isolation -e . 2>/dev/null || $(PIP_INSTALL) --no-deps -e .; } \
	  || { rm -rf $(VENV); echo "error: the install into $(VENV) failed (its message is above); $(VENV) was removed, so nothing is left half-installed: run make again once that is fixed" >&2; exit 1; }
	@touch $@
	@echo "setup done: activate with 'source $(VENV)/bin/activate'"

existing-python: ## with PY=python3: which torch that interpreter holds (it replaces .venv for every target)
	@$(PY) tools/check_torch.py

setup: $(STAMP) ## create .venv and install the pinned dependencies (once; idempotent)

data: $(STAMP) ## download real MNIST and CIFAR-10 into data/ (needs internet), and write the offline stand-ins
	$(PY) -c 'from tools import data; [print(n, "->", data.try_download(n, "data") or "ok") for n in ("mnist", "cifar10")]'
	$(PY) -c 'import common; [common.prepare_data(n, "data") for n in ("mnist-standin", "cifar10-standin")]'

# NPROC must be a number; processes beyond the cores are slower, not faster (a warning); processes that cannot
# fit in memory (about 1 GB each with this torch) are refused before any starts, not killed one by one later
check-nproc:
	@case "$(NPROC)" in ''|*[!0-9]*|0) echo "error: NPROC must be a whole number of at least 1 (got '$(NPROC)')" >&2; exit 2;; esac
	@procs=$(LOCAL_PROCS); cores=$$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo $$procs); \
	  free=$$(awk '/^MemAvailable:/ {print int($$2 / 1024)}' /proc/meminfo 2>/dev/null); free=$${free:-0}; \
	  if [ "$$free" -gt 0 ] && [ $$((procs * 1000)) -gt "$$free" ]; then \
	    echo "error: $$procs processes need about $$procs GB of memory (about 1 GB each) and $$free MB are available; use fewer (NPROC)" >&2; exit 2; fi; \
	  if [ "$$procs" -gt "$$cores" ] && [ "$(GPUS)" = 0 ]; then \
	    echo "WARNING: $$procs processes on $$cores CPU cores: each gets a share of a core, so this is slower than NPROC=$$cores, not faster"; fi

check-nnodes:
	@case "$(NNODES)" in ''|*[!0-9]*|0) echo "error: NNODES must be a whole number of at least 1 (got '$(NNODES)')" >&2; exit 2;; esac

# ------------------------------------------------------------------ 01: single process and DataParallel

smoke: $(STAMP) ## the single-process MNIST baseline, one epoch on the offline stand-in (or DATASET=auto|mnist)
	@$(PY) tools/preflight.py --run $(PY) 01_dataparallel/mnist_single.py --dataset $(or $(DATASET),mnist-standin) --epochs 1 $(ARGS)

dataparallel: $(STAMP) ## MNIST with nn.DataParallel over all visible GPUs (on CPU: the module is called as is)
	@$(PY) tools/preflight.py --run $(PY) 01_dataparallel/mnist_dataparallel.py $(TRAIN_ARGS)

dp-shapes: $(STAMP) ## watch DataParallel split a batch (simulated for 2 GPUs on a CPU machine)
	$(PY) 01_dataparallel/dataparallel_shapes.py $(ARGS)

# ------------------------------------------------------------------ 02: DDP with mp.spawn

DEMOS ?= basic checkpoint model-parallel process

ddp-basics: $(STAMP) check-nproc ## the toy DDP demos: basic, checkpoint, model parallel, bare mp.Process (DEMOS= some)
	$(PY) 02_ddp_spawn/ddp_basics.py $(DEMOS) --nproc $(NPROC) $(if $(BACKEND),--backend $(BACKEND)) $(ARGS)

ddp-equivalence: $(STAMP) check-nproc ## proof that DDP averages gradients (and the BatchNorm caveat)
	$(PY) 02_ddp_spawn/ddp_equivalence.py --nproc $(NPROC) $(ARGS)

ddp-spawn: $(STAMP) check-nproc ## MNIST with DDP, NPROC processes started by mp.spawn
	@$(PREFLIGHT) --run $(PY) 02_ddp_spawn/mnist_spawn.py --nproc $(NPROC) $(DIST_ARGS)

ddp-timeline: $(STAMP) check-nproc ## see DDP's all-reduce overlap backward: per-rank timelines, traces, PNGs (runs/timeline)
	$(PY) 02_ddp_spawn/ddp_timeline.py --nproc $(NPROC) $(ARGS)

# ------------------------------------------------------------------ 03: torchrun

# --local-addr: single-node jobs never depend on this machine's host name resolving (it may not)
TORCHRUN := $(PY) -m torch.distributed.run --standalone --local-addr 127.0.0.1 --nproc-per-node $(NPROC)
ELASTIC  ?= runs/elastic
# the failure demo: rank FAIL_RANK fails at this training batch (counted over epochs) on the first attempt only;
# mid: the middle batch of the last epoch, whatever the data set size, NPROC and batch size (tools/tracer.py)
FAIL_AT  ?= mid
FAIL_RANK ?= $(if $(filter 1,$(NPROC)),0,1)

ddp-torchrun: $(STAMP) check-nproc ## MNIST with DDP, NPROC processes started by torchrun (the headline run)
	@$(PREFLIGHT) --run $(TORCHRUN) 03_ddp_torchrun/mnist_torchrun.py $(DIST_ARGS)

init-check: $(STAMP) check-nproc ## can a process group form? each rank reports, one all_reduce proves it
	$(TORCHRUN) 03_ddp_torchrun/init_check.py $(if $(BACKEND),--backend $(BACKEND)) $(ARGS)

ddp-minimal: $(STAMP) check-nproc ## the smallest torchrun + DDP program, elastic_ddp.py (a line learned from numbers)
	$(TORCHRUN) 03_ddp_torchrun/elastic_ddp.py

elastic-restart: $(STAMP) check-nproc ## a worker crashes once, torchrun restarts the group, training resumes: same weights
	@$(PREFLIGHT) 03_ddp_torchrun/mnist_torchrun.py $(DIST_ARGS)
	@rm -rf $(ELASTIC)
	@echo "--- 1/3 an uninterrupted run"
	$(TORCHRUN) 03_ddp_torchrun/mnist_torchrun.py --checkpoint-dir $(ELASTIC)/straight $(DIST_ARGS)
	@echo "--- 2/3 the same run; rank $(FAIL_RANK) fails at $(if $(filter mid,$(FAIL_AT)),the middle of the last epoch,training batch $(FAIL_AT)) (injected from outside by the"
	@echo "    course's tracer), torchrun restarts the group (--max-restarts 1) and it resumes from its checkpoint"
	COURSE_TRACE=$(ELASTIC)/trace PYTHONPATH=tools/trace:$(PYTHONPATH) COURSE_FAIL_AT=$(FAIL_RANK):$(FAIL_AT) \
	TORCH_DISABLE_SHARE_RDZV_TCP_STORE=$(if $(filter off,$(COURSE_WORKAROUNDS)),0,1) \
	  $(TORCHRUN) --max-restarts 1 03_ddp_torchrun/mnist_torchrun.py --checkpoint-dir $(ELASTIC)/recovered $(DIST_ARGS)
	@$(PY) tools/tracecheck.py $(ELASTIC)/trace --expect-restart --quiet
	@echo "--- 3/3 compare the final weights"
	$(PY) 03_ddp_torchrun/compare_checkpoints.py $(ELASTIC)/straight/mnist_torchrun.pt $(ELASTIC)/recovered/mnist_torchrun.pt

# Repeated runs of a case that can fail at random, alternately with COURSE_WORKAROUNDS=on and off (bench/stress.py
# says what the switch changes in each case); the record goes to BENCH_OUT as stress_<case>_<machine>_<date>.json
# and .md. RUNS=N runs each way.
RUNS ?= 10
elastic-stress: $(STAMP) check-nproc ## the restart demo RUNS times with, RUNS without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
	$(PY) bench/stress.py elastic --runs $(RUNS) --nproc $(NPROC) --output-dir $(BENCH_OUT) $(ARGS)

exit-stress: $(STAMP) ## a finished 3-rank job 2 x RUNS times: how often it exits cleanly (no os._exit guard left)
	$(PY) bench/stress.py exit --runs $(RUNS) --output-dir $(BENCH_OUT) $(ARGS)

free-stress: $(STAMP) ## a finished 2-rank job RUNS times each way: its DDP model freed before destroy_process_group or not
	$(PY) bench/stress.py free --runs $(RUNS) --output-dir $(BENCH_OUT) $(ARGS)

launch-legacy: $(STAMP) check-nproc ## the deprecated python -m torch.distributed.launch (passes --local-rank)
	@$(PREFLIGHT) --run $(PY) -m torch.distributed.launch --local-addr 127.0.0.1 --nproc-per-node $(NPROC) 03_ddp_torchrun/mnist_torchrun.py $(DIST_ARGS)

# ------------------------------------------------------------------ 04: several nodes

RDZV ?= static

# The simulated nodes share this machine's GPUs: unless NPROC is given, each of N nodes runs GPUS / N processes
# (one per GPU), or 2 on the CPU where there are fewer GPUs than nodes.
node_nproc = $(or $(NPROC_GIVEN),$(shell g=$(GPUS); n=$(1); [ "$$n" -gt 0 ] 2>/dev/null && [ "$$g" -ge "$$n" ] \
               && echo $$((g / n)) || echo 2))
multinode-tcp multinode-file multinode-torchrun: NPROC = $(call node_nproc,$(NNODES))
multinode-tcp multinode-file multinode-torchrun: LOCAL_PROCS = $(shell echo $$(( $(NNODES) * $(NPROC) )))

multinode-tcp: $(STAMP) check-nnodes check-nproc ## NNODES "nodes" x NPROC processes here, each started by hand with tcp://
	PYTHON=$(PY) bash 04_multinode_tcp/launch_local.sh tcp $(NNODES) $(NPROC) $(DIST_ARGS)

multinode-file: $(STAMP) check-nnodes check-nproc ## the same, meeting through a fresh file:// path instead
	PYTHON=$(PY) bash 04_multinode_tcp/launch_local.sh file $(NNODES) $(NPROC) $(DIST_ARGS)

multinode-torchrun: $(STAMP) check-nnodes check-nproc ## NNODES torchrun agents here; RDZV=static (default) or c10d
	PYTHON=$(PY) bash 04_multinode_tcp/launch_torchrun_nodes.sh $(RDZV) $(NNODES) $(NPROC) $(DIST_ARGS)

PROCS ?= 2,1
multinode-spawn: LOCAL_PROCS = $(shell echo $$(( $(subst $(comma),+,$(PROCS)) )) 2>/dev/null)
multinode-spawn: $(STAMP) check-nproc ## one command per "machine" spawns its processes; PROCS=2,1: machines of 2 and 1
	$(PY) 04_multinode_tcp/spawn_per_node.py --nproc-per-node $(PROCS) --simulate-nodes $(ARGS)

multinode-netns: NPROC = $(call node_nproc,2)
multinode-netns: LOCAL_PROCS = $(shell echo $$(( 2 * $(NPROC) )))
multinode-netns: $(STAMP) check-nproc ## two real hosts in network namespaces (needs root); NPROC per host
	PYTHON=$(PY) bash 04_multinode_tcp/netns_2hosts.sh $(NPROC) $(DIST_ARGS)

# ------------------------------------------------------------------ 05: communication

collectives: $(STAMP) check-nproc ## every collective on small tensors, before/after per rank, each checked (NPROC>=2)
	$(TORCHRUN) 05_collectives/collectives.py $(if $(BACKEND),--backend $(BACKEND)) $(ARGS)

p2p: $(STAMP) check-nproc ## send/recv, isend/irecv and a ring with batch_isend_irecv
	$(TORCHRUN) 05_collectives/p2p.py $(ARGS)

backend-matrix: $(STAMP) ## measure which ops and dtypes this backend supports (ARGS="--output-dir DIR" keeps it)
	$(PY) -m torch.distributed.run --standalone --local-addr 127.0.0.1 --nproc-per-node 2 05_collectives/backend_matrix.py \
	  $(if $(BACKEND),--backend $(BACKEND)) $(ARGS)

ddp-eval: $(STAMP) check-nproc ## exact distributed evaluation with reduce vs the padded DistributedSampler count
	$(TORCHRUN) 05_collectives/distributed_eval.py $(ARGS)

ddp-from-scratch: $(STAMP) check-nproc ## data parallelism with broadcast + all_reduce by hand, compared with DDP
	$(TORCHRUN) 05_collectives/ddp_from_scratch.py $(ARGS)

hang-demo: $(STAMP) check-nproc ## a rank takes a different path: fails in seconds, naming it (succeeds when it fails)
	@echo "--- 1/2 a collective only rank 0 calls, with TORCH_DISTRIBUTED_DEBUG=DETAIL"
	@if TORCH_DISTRIBUTED_DEBUG=DETAIL $(TORCHRUN) 05_collectives/hang_demo.py --mode mismatch $(ARGS); then \
	  echo "error: the mismatch was not detected"; exit 1; else echo "--- failed in seconds, as it should"; fi
	@echo "--- 2/2 rank 1 is stuck; rank 0 waits in monitored_barrier"
	@if $(TORCHRUN) 05_collectives/hang_demo.py --mode straggler $(ARGS); then \
	  echo "error: the straggler was not detected"; exit 1; else echo "--- failed in seconds, as it should"; fi

SCRIPT ?=
doctor: $(STAMP) ## check-up of your own DDP script: make doctor SCRIPT=/path/to/train.py ARGS="--epochs 2" [NPROC=2]
	@test -n "$(SCRIPT)" || { echo "error: name your script: make doctor SCRIPT=/path/to/train.py ARGS='--epochs 2'" >&2; exit 2; }
	$(PY) tools/doctor.py --nproc $(if $(filter 0 1,$(NPROC)),2,$(NPROC)) $(abspath $(SCRIPT)) $(ARGS)

errors: $(STAMP) ## the error gallery: each classic DDP error made on purpose, broken then fixed (about 2 minutes)
	$(PY) 05_collectives/error_gallery.py $(ARGS)

# ------------------------------------------------------------------ 06: mixed precision and SyncBatchNorm

amp-syncbn: $(STAMP) check-nproc ## MNIST with autocast (bf16 on CPU, fp16 + GradScaler on GPU) and SyncBatchNorm
	@$(PREFLIGHT) --run $(TORCHRUN) 06_amp_syncbn/mnist_amp_syncbn.py --sync-bn $(DIST_ARGS)

syncbn-proof: $(STAMP) check-nproc ## the all_reduce batch norm equals BatchNorm2d over the global batch
	$(TORCHRUN) 06_amp_syncbn/syncbn_by_hand.py $(ARGS)

grad-accum: $(STAMP) check-nproc ## gradient accumulation with no_sync: same gradients, fewer all-reduces
	$(TORCHRUN) 06_amp_syncbn/grad_accumulation.py $(ARGS)

cifar-resnet: $(STAMP) check-nproc ## ResNet-18 on CIFAR-10 (the stand-in offline): augmentation, AMP, eval, resume
	@$(PREFLIGHT) --run $(TORCHRUN) 06_amp_syncbn/cifar_resnet.py $(if $(EPOCHS),,--epochs 1 --max-steps 25) $(DIST_ARGS)

# ------------------------------------------------------------------ 07: beyond DDP

fsdp: $(STAMP) check-nproc ## MNIST with FSDP2 (fully_shard): 1/N of every weight per rank; sharded checkpoints
	@$(PREFLIGHT) --run $(TORCHRUN) 07_beyond_ddp/mnist_fsdp2.py $(DIST_ARGS)

zero: $(STAMP) check-nproc ## MNIST with DDP and ZeroRedundancyOptimizer: 1/N of the optimizer state per rank
	@$(PREFLIGHT) --run $(TORCHRUN) 07_beyond_ddp/mnist_zero_compile.py --zero $(DIST_ARGS)

compile: $(STAMP) check-nproc ## MNIST with torch.compile(DDP model): the first step compiles (CPU: needs g++)
	@$(PREFLIGHT) --run $(TORCHRUN) 07_beyond_ddp/mnist_zero_compile.py --compile $(DIST_ARGS)

uneven: $(STAMP) check-nproc ## ranks with different numbers of batches: fails at a 5 s timeout; with Join it ends
	@echo "--- without Join: the job fails after its timeout ---"
	-$(TORCHRUN) 07_beyond_ddp/uneven_join.py $(ARGS)
	@echo "--- with Join ---"
	$(TORCHRUN) 07_beyond_ddp/uneven_join.py --join $(ARGS)

bench-memory: $(STAMP) ## bytes of weights, gradients, optimizer state per rank: DDP, ZeRO, FSDP2 at 1, 2, 4 ranks
	$(PY) bench/memory.py --output-dir $(BENCH_OUT) $(QUICK) $(ARGS)

# ------------------------------------------------------------------ benchmarks

# Every benchmark writes NAME_BACKEND_MACHINE_DATE.{json,md,png} into BENCH_OUT (runs/bench: nothing tracked is
# overwritten; BENCH_OUT=bench/results records them). They run one after the other, never side by side: two
# benchmarks at once would measure each other.
BENCH_OUT  ?= runs/bench
BENCH_DATA ?= data
QUICK      ?=
BENCH_RUN := $(PY) -m torch.distributed.run --standalone --local-addr 127.0.0.1 --nproc-per-node $(NPROC)

bench: $(STAMP) check-nproc ## the full benchmark set, one after the other (about 5 minutes on 2 CPU cores)
	@$(MAKE) --no-print-directory bench-throughput bench-amp bench-buckets bench-allreduce bench-hooks ARGS=
	@echo "results in $(BENCH_OUT)/; bench/README.md explains how to read them"

bench-quick: $(STAMP) check-nproc ## every benchmark at tiny sizes (under a minute): proves they run; runs/bench/quick/
	@$(MAKE) --no-print-directory bench-throughput bench-amp bench-buckets bench-allreduce bench-hooks ARGS= QUICK=--quick \
	  BENCH_OUT=$(if $(filter runs/bench,$(BENCH_OUT)),runs/bench/quick,$(BENCH_OUT))

bench-throughput: $(STAMP) ## ConvNet images/s: plain, course loop, DataParallel, DDP ws1, mp.spawn and torchrun ws2
	$(PY) bench/throughput.py --output-dir $(BENCH_OUT) --data-dir $(BENCH_DATA) $(QUICK) \
	  $(if $(filter command line environment,$(origin NPROC)),--world-sizes $(NPROC)) $(ARGS)

bench-amp: $(STAMP) ## fp32 vs bf16 autocast (and fp16 + GradScaler on CUDA), ConvNet and ResNet-18
	$(PY) bench/amp.py --output-dir $(BENCH_OUT) $(QUICK) $(ARGS)

bench-buckets: $(STAMP) check-nproc ## DDP bucket_cap_mb sweep for ResNet-18 with NPROC processes
	$(BENCH_RUN) bench/buckets.py --output-dir $(BENCH_OUT) $(QUICK) $(ARGS)

bench-allreduce: $(STAMP) check-nproc ## collectives and a p2p ring from 4 KB to 256 MB: latency, algbw, busbw
	$(BENCH_RUN) bench/allreduce_sweep.py --output-dir $(BENCH_OUT) $(QUICK) $(ARGS)

bench-hooks: $(STAMP) check-nproc ## DDP comm hooks: all_reduce vs fp16/bf16 compression vs PowerSGD (bytes, speed, accuracy)
	$(BENCH_RUN) bench/comm_hooks.py --output-dir $(BENCH_OUT) --data-dir $(BENCH_DATA) $(QUICK) $(ARGS)

bench-versions: $(STAMP) ## this version vs an older one (OLD=commit) on the CPU: one MNIST epoch, single/spawn/torchrun
	@test -n "$(OLD)" || { echo "error: give the older version, e.g. make bench-versions OLD=7cfce49" >&2; exit 2; }
	$(PY) bench/versions.py --old $(OLD) --output-dir $(BENCH_OUT) $(QUICK) $(ARGS)

TORCH ?=
RECORD ?=
WITH ?=
compat: ## TORCH=2.11.0: the whole suite on another torch (a side .venv-torch2.11.0); WITH=matplotlib; RECORD=1 keeps it
	@test -n "$(TORCH)" || { echo "error: name the torch release: make compat TORCH=2.11.0" >&2; exit 2; }
	$(PYTHON) tools/compat.py --torch $(TORCH) $(if $(WITH),--with $(WITH)) $(if $(RECORD),--record)

# One command of about 9 minutes on a GPU host with 8 cores or more (a borrowed GPU machine gives one command 10):
# the figures on the idle GPU, then the suite and every CUDA step side by side (bench/gpu_check.py). Results go to
# runs/gpu_check/ (OUT_DIR= elsewhere; RECORD=1: bench/results/). A host with fewer cores runs the same steps in
# parts: PART=list shows them, PART=NAME runs one. With PY=... on the command line every step uses that interpreter.
PART ?=
OUT_DIR ?=
gpu-check: $(STAMP) ## on a GPU machine: GPU figures, then the suite and every CUDA step side by side, in one command
	$(PY) bench/gpu_check.py $(if $(PART),--part $(PART)) $(if $(filter-out 0 no,$(RECORD)),--record) \
	  $(if $(OUT_DIR),--output-dir $(OUT_DIR)) $(if $(filter command line,$(origin PY)),--py $(PY)) $(ARGS)

# ------------------------------------------------------------------ tests and tools

PYTEST := $(PY) -m pytest
NBVAL  := --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg

# With PY=..., an interpreter that lacks ruff or nbval runs the rest: lint and the notebooks are skipped, each with a line
test: $(STAMP) ## lint, then everything that runs on CPU: unit, multi-process and notebook tests (CI runs this)
	@$(PY) -c 'import pytest' 2>/dev/null || { echo "error: $(PY) has no pytest: install pytest into it (pytest-timeout and pytest-xdist help)" >&2; exit 2; }
	@if $(PY) -m ruff --version >/dev/null 2>&1; then echo "$(PY) -m ruff check ."; $(PY) -m ruff check .; \
	  else echo "lint skipped: $(PY) has no ruff"; fi
	@nb=$$($(PY) -c 'import nbval' 2>/dev/null && echo "notebooks $(NBVAL)") || echo "notebooks skipped: $(PY) has no nbval"; \
	  xd=$$($(PY) -c 'import xdist' 2>/dev/null && echo "-n 2"); \
	  echo "$(PYTEST) $$xd tests $$nb"; $(PYTEST) $$xd tests $$nb

test-fast: $(STAMP) ## the quick subset for the edit loop (no slow multi-process runs, no notebooks)
	$(PYTEST) tests -m "not slow" $(ARGS)

notebooks: $(STAMP) ## write each .ipynb from its .py source (jupytext), execute it, keep its outputs
	@cd notebooks && for nb in $(if $(NB),$(notdir $(NB)),0*.py); do echo "--- $$nb"; \
	  $(PYABS) -m jupytext --quiet --to ipynb --update "$$nb" && \
	  $(PYABS) -m jupyter nbconvert --log-level WARN --to notebook --execute --inplace "$${nb%.py}.ipynb" || exit 1; \
	done

diffs: $(STAMP) ## rewrite the step-to-step diffs of the MNIST chain in the section READMEs
	$(PY) tools/chain_diffs.py --write

mutants: $(STAMP) ## break each DDP chain script and cifar_resnet.py on purpose (sampler, set_epoch, DDP, all_reduce, buffers): a trace check must go red
	$(PY) tools/mutants.py $(ARGS)

lint: $(STAMP) ## ruff
	$(PY) -m ruff check .

clean: ## remove checkpoints, runs and caches
	rm -rf checkpoints runs .pytest_cache .ruff_cache
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean ## also remove the virtualenv and all data
	rm -rf $(VENV) data *.egg-info
