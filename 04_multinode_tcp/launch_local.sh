#!/usr/bin/env bash
# Start NNODES x NPROC copies of mnist_tcp.py on this machine, as if on NNODES machines, each with its
# explicit rank: no launcher, exactly what you would type on every node by hand (each command is printed).
#
#   04_multinode_tcp/launch_local.sh tcp  NNODES NPROC [arguments for mnist_tcp.py]
#   04_multinode_tcp/launch_local.sh file NNODES NPROC [arguments for mnist_tcp.py]
#
# On a GPU machine each simulated node gets its own GPUs (CUDA_VISIBLE_DEVICES, numbered from 0 inside the node,
# as on a real one); with fewer GPUs than processes all of them run on the CPU, and a NOTE says so.
# If any process fails, the others are stopped at once. PYTHON picks the interpreter (default: python).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # every rank imports common.py from here, with any interpreter

method=${1:-}; nnodes=${2:-}; nproc=${3:-}
if [[ ! $method =~ ^(tcp|file)$ || ! $nnodes =~ ^[1-9][0-9]*$ || ! $nproc =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 tcp|file NNODES NPROC [arguments for mnist_tcp.py]" >&2
  exit 2
fi
shift 3
py=${PYTHON:-python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # as torchrun does: every process on this machine shares its cores
world=$((nnodes * nproc))

workdir=$(mktemp -d)
if [[ $method == tcp ]]; then
  port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')  # free now: the OS picks it (common.free_port would import torch)
  init="tcp://127.0.0.1:$port"          # on real machines: node 0's address, reachable from all nodes
else
  init="file://$workdir/ddp-init"       # must be new for every job: a file left from an old job can hang
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}   # all the "nodes" share this machine's cores
mapfile -t node_gpus < <("$py" 04_multinode_tcp/gpus_per_node.py "$nnodes" "$nproc")

pids=()
watcher=
cleanup() {
  for pid in "${pids[@]}" $watcher; do kill "$pid" 2>/dev/null || true; done
  rm -rf "$workdir"
}
trap cleanup EXIT INT TERM
# if whoever started this script (make, a shell) is killed, stop too: the processes must not train on alone
# (make may run this through a shell: that shell outlives a killed make, but its own parent then changes)
parent=$PPID; above=$(awk '{print $4}' "/proc/$parent/stat" 2>/dev/null || true)
( while kill -0 "$parent" 2>/dev/null && [ "$(awk '{print $4}' "/proc/$parent/stat" 2>/dev/null)" = "$above" ]; do
    sleep 1
  done; kill -TERM $$ 2>/dev/null ) &
watcher=$!
# one process checks the arguments and prepares the data first: a mistake is one line, not one per process
"$py" tools/preflight.py 04_multinode_tcp/mnist_tcp.py --init-method "$init" --world-size "$world" \
  --nproc-per-node "$nproc" --node-rank 0 --local-rank 0 "$@"

for ((node = 0; node < nnodes; node++)); do
  gpus=${node_gpus[$node]}
  for ((local = 0; local < nproc; local++)); do
    cmd=("$py" 04_multinode_tcp/mnist_tcp.py --init-method "$init" --world-size "$world"
         --nproc-per-node "$nproc" --node-rank "$node" --local-rank "$local")
    if [[ $gpus == cpu ]]; then
      cmd+=(--device cpu)                                  # too few GPUs for one per process
    elif [[ -n $gpus ]]; then
      cmd=(env "CUDA_VISIBLE_DEVICES=$gpus" "${cmd[@]}")   # this node's GPUs, numbered from 0 inside it
    fi
    echo "node $node, process $local: ${cmd[*]} $*"
    "${cmd[@]}" "$@" &
    pids+=($!)
  done
done

for _ in "${pids[@]}"; do
  if ! wait -n; then
    echo "a process failed: stopping the others" >&2
    exit 1
  fi
done
echo "all $world processes finished"
