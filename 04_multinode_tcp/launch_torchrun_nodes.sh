#!/usr/bin/env bash
# Run NNODES torchrun agents on this machine, as if on NNODES machines, each starting NPROC workers of
# 03_ddp_torchrun/mnist_torchrun.py. Two ways for the nodes to find each other:
#
#   static: every node is told the job size, its own --node-rank and the master's address and port
#   c10d:   every node is told a rendezvous endpoint and job id; node ranks follow the agents' host addresses, then
#           their process ids (not arrival order; --node-rank is ignored)
#
#   04_multinode_tcp/launch_torchrun_nodes.sh static|c10d NNODES NPROC [arguments for mnist_torchrun.py]
#   JOIN_TIMEOUT=30 (seconds a node waits for the others; torchrun's default is 600)
#   ONLY_NODES="0"  (start only these nodes: shows what happens when one never arrives)
#
# On a GPU machine each simulated node gets its own GPUs (CUDA_VISIBLE_DEVICES, numbered from 0 inside the node,
# as on a real one); with fewer GPUs than processes all of them run on the CPU, and a NOTE says so.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # every rank imports common.py from here, with any interpreter

mode=${1:-}; nnodes=${2:-}; nproc=${3:-}
if [[ ! $mode =~ ^(static|c10d)$ || ! $nnodes =~ ^[1-9][0-9]*$ || ! $nproc =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 static|c10d NNODES NPROC [arguments for mnist_torchrun.py]" >&2
  exit 2
fi
shift 3
py=${PYTHON:-python}
port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')  # free now: the OS picks it (common.free_port would import torch)
join_timeout=${JOIN_TIMEOUT:-30}
only=${ONLY_NODES:-$(seq -s ' ' 0 $((nnodes - 1)))}
mapfile -t node_gpus < <("$py" 04_multinode_tcp/gpus_per_node.py "$nnodes" "$nproc")

pids=()
watcher=
cleanup() { for pid in "${pids[@]}" $watcher; do kill "$pid" 2>/dev/null || true; done; }
trap cleanup EXIT INT TERM
# if whoever started this script (make, a shell) is killed, stop too: the agents must not train on alone
# (make may run this through a shell: that shell outlives a killed make, but its own parent then changes)
parent=$PPID; above=$(awk '{print $4}' "/proc/$parent/stat" 2>/dev/null || true)
( while kill -0 "$parent" 2>/dev/null && [ "$(awk '{print $4}' "/proc/$parent/stat" 2>/dev/null)" = "$above" ]; do
    sleep 1
  done; kill -TERM $$ 2>/dev/null ) &
watcher=$!
# one process checks the arguments and prepares the data first: a mistake is one line, not one per process
"$py" tools/preflight.py --nproc "$nproc" --nnodes "$nnodes" 03_ddp_torchrun/mnist_torchrun.py "$@"

for node in $only; do
  if [[ $mode == static ]]; then
    rdzv=(--nnodes "$nnodes" --node-rank "$node" --master-addr 127.0.0.1 --master-port "$port"
          --rdzv-conf "timeout=$join_timeout")
  else
    rdzv=(--nnodes "$nnodes" --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$port" --rdzv-id "job-$port"
          --rdzv-conf "join_timeout=$join_timeout")
  fi
  # --local-addr: every "node" is this machine, whose host name may not resolve (torchrun would wait on it)
  cmd=("$py" -m torch.distributed.run "${rdzv[@]}" --local-addr 127.0.0.1 --nproc-per-node "$nproc"
       03_ddp_torchrun/mnist_torchrun.py)
  gpus=${node_gpus[$node]}
  if [[ $gpus == cpu ]]; then
    cmd+=(--device cpu)                                  # too few GPUs for one per process
  elif [[ -n $gpus ]]; then
    cmd=(env "CUDA_VISIBLE_DEVICES=$gpus" "${cmd[@]}")   # this node's GPUs, numbered from 0 inside it
  fi
  echo "node $node: ${cmd[*]} $*"
  "${cmd[@]}" "$@" &
  pids+=($!)
done

for _ in "${pids[@]}"; do
  if ! wait -n; then
    echo "a node failed: stopping the others" >&2
    exit 1
  fi
done
echo "all nodes finished"
