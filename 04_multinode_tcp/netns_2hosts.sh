#!/usr/bin/env bash
# A real two-host run on one Linux machine: two network namespaces ("hosts") joined by a virtual cable (a
# veth pair). Each host has its own network stack: one interface, one address, its own loopback. Node 0
# runs in the first, node 1 in the second, and they meet at node 0's address, as two machines would.
#
#   sudo 04_multinode_tcp/netns_2hosts.sh [NPROC] [arguments for mnist_tcp.py]
#   BREAK=1 sudo 04_multinode_tcp/netns_2hosts.sh ...   # without GLOO_SOCKET_IFNAME: see it fail
#
# Needs root and iproute2. Without them it explains and exits with code 77. The namespaces and the cable
# are removed afterwards, also on failure or Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."

nproc=${1:-1}
[[ $# -gt 0 ]] && shift
if [[ ! $nproc =~ ^[1-9][0-9]*$ ]]; then echo "usage: $0 [NPROC] [arguments for mnist_tcp.py]" >&2; exit 2; fi
if [[ $(id -u) != 0 ]] || ! command -v ip >/dev/null; then
  echo "netns_2hosts: needs root and the 'ip' command (iproute2) to create network namespaces;" \
       "run it with sudo on Linux. Nothing was changed." >&2
  exit 77
fi
py=${PYTHON:-python}
py=$(command -v "$py")

tag=$$                                   # unique names: several runs can coexist
ns=("ddp0-$tag" "ddp1-$tag"); dev=("veth0-$tag" "veth1-$tag")
net="10.213.$((tag % 250)).0"; addr=("${net%.0}.1" "${net%.0}.2")
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for n in "${ns[@]}"; do ip netns delete "$n" 2>/dev/null || true; done   # takes its end of the cable along
}
trap cleanup EXIT INT TERM

for i in 0 1; do ip netns add "${ns[$i]}"; done
ip link add "${dev[0]}" netns "${ns[0]}" type veth peer name "${dev[1]}" netns "${ns[1]}"
for i in 0 1; do
  ip -n "${ns[$i]}" addr add "${addr[$i]}/24" dev "${dev[$i]}"
  ip -n "${ns[$i]}" link set "${dev[$i]}" up
  ip -n "${ns[$i]}" link set lo up
  echo "host $i: namespace ${ns[$i]}, interface ${dev[$i]}, address ${addr[$i]}"
done

world=$((2 * nproc))
mapfile -t host_gpus < <("$py" 04_multinode_tcp/gpus_per_node.py 2 "$nproc")  # each "host" its own GPUs
for i in 0 1; do
  for ((local = 0; local < nproc; local++)); do
    # GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME, for NCCL) name the interface to use; without it Gloo takes
    # its address from the host name, which here resolves to 127.0.0.1: each host would send the other to
    # its own loopback
    ifname=(); [[ -z ${BREAK:-} ]] && ifname=(GLOO_SOCKET_IFNAME="${dev[$i]}" NCCL_SOCKET_IFNAME="${dev[$i]}")
    # both "hosts" share this machine's host name and boot id: NCCL would take them for one host without this
    hostid=(NCCL_HOSTID="ddp-host-$i")
    # on a machine with InfiniBand or RoCE cards NCCL would take its IB transport, which knows nothing of the veth
    # (NCCL_SOCKET_IFNAME names a socket interface only): sockets over the cable, as between two Ethernet hosts
    sockets=(NCCL_IB_DISABLE=1 NCCL_NET=Socket)
    gpus=${host_gpus[$i]}; cuda=(); device=()
    if [[ $gpus == cpu ]]; then device=(--device cpu); elif [[ -n $gpus ]]; then cuda=(CUDA_VISIBLE_DEVICES="$gpus"); fi
    cmd=(env "${ifname[@]}" "${hostid[@]}" "${sockets[@]}" "${cuda[@]}" OMP_NUM_THREADS=1 "$py" 04_multinode_tcp/mnist_tcp.py
         --init-method "tcp://${addr[0]}:29500" --world-size "$world" --nproc-per-node "$nproc"
         --node-rank "$i" --local-rank "$local" "${device[@]}" "$@")
    echo "host $i: ${cmd[*]}"
    ip netns exec "${ns[$i]}" "${cmd[@]}" &
    pids+=($!)
  done
done

for _ in "${pids[@]}"; do
  if ! wait -n; then echo "a process failed: stopping the others" >&2; exit 1; fi
done
echo "both hosts finished"
