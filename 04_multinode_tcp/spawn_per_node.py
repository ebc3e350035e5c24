"""One command per machine, which starts that machine's processes itself with mp.spawn; machines may differ in size.

This is the launch cheat-sheet's pattern (`python demo.py --world_size=16 --node_rank=0 --master_addr=...`),
and it also runs the DP/DDP notes' example of two machines with 2 GPUs and 1 GPU. On each machine:

    python 04_multinode_tcp/spawn_per_node.py --nproc-per-node 2,1 --node-rank 0 --master-addr 10.0.0.1 \
        --master-port 29500
    python 04_multinode_tcp/spawn_per_node.py --nproc-per-node 2,1 --node-rank 1 --master-addr 10.0.0.1 \
        --master-port 29500

--nproc-per-node lists every machine's process count (or one number for all, with --nnodes). The arithmetic the
launchers otherwise do for you: world size = the sum of the counts; the global rank of local process l on
machine n = (the processes of the machines before n) + l, so with 2,1 the ranks are 0, 1 on machine 0 and 2 on
machine 1. The local rank picks the GPU, and is NOT unique in the job: every machine has a local rank 0.

On one machine, --simulate-nodes starts one such command per "machine" as a subprocess and waits for them:

    python 04_multinode_tcp/spawn_per_node.py --nproc-per-node 2,1 --simulate-nodes
    make multinode-spawn PROCS=2,1

Every process learns a line (y = 2x + 1) with DDP from its own samples, then rank 0 checks that all ranks hold
the same weights. On a GPU machine each simulated machine gets its own GPUs (CUDA_VISIBLE_DEVICES, numbered from 0
inside it); with too few for one per process everything runs on the CPU.
"""

import argparse
import gc
import os
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import common


def rank_of(counts: list[int], node: int, local: int) -> int:
    """Global rank of local process `local` on machine `node`: the processes of the machines before it, + local."""
    return sum(counts[:node]) + local


def worker(local_rank, counts, args):
    """One process: join the job with its global rank, learn the line with DDP, compare the weights."""
    rank, world_size = rank_of(counts, args.node_rank, local_rank), sum(counts)
    here = counts[args.node_rank]
    device, backend = common.device_and_backend(args.device, args.backend, local_rank, here)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # DDP: this process's GPU; every later CUDA and NCCL call uses it
    # DDP: env://, as the notes do it: every process was told the master's address and port, and its own rank
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=args.timeout),
                            device_id=device if backend == "nccl" else None)
    try:
        # every rank prints: the newline inside the string and end="" make one write, so lines never mix
        print(f"rank {rank} = {sum(counts[:args.node_rank])} (processes on the machines before) + local rank "
              f"{local_rank}, on machine {args.node_rank}, {device}\n", end="", flush=True)
        torch.manual_seed(rank)  # DDP: different samples on every rank; the wrap makes the weights equal
        model = DDP(nn.Linear(1, 1).to(device), device_ids=[device.index] if device.type == "cuda" else None)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(args.steps):
            x = torch.rand(32, 1, device=device) * 2 - 1
            loss = ((model(x) - (2 * x + 1)) ** 2).mean()
            optimizer.zero_grad()
            loss.backward()  # DDP: the gradients of all ranks, averaged
            optimizer.step()
        weights = [model.module.weight.item(), model.module.bias.item()]
        every = [None] * world_size
        dist.all_gather_object(every, weights)  # DDP: rank 0 compares everyone's weights
        if rank == 0:
            agree = all(w == every[0] for w in every)
            print(f"result: world_size={world_size} machines={len(counts)} w={weights[0]:.3f} "
                  f"b={weights[1]:.3f} ranks_agree={agree}", flush=True)
        dist.barrier()  # DDP: every rank finishes its work before any tears the group down
    finally:
        gc.collect()  # a workaround, not DDP: free the DDP model (it lives in reference cycles) before its group
        dist.destroy_process_group()  # DDP: leave the group, also after an error


def simulate(counts: list[int], args) -> int:
    """Start one command per machine on this one, each with its own GPUs, and wait; stop all if one fails."""
    port = common.free_port()
    gpus = _visible_gpus()
    enough = len(gpus) >= sum(counts)
    procs = []
    for node in range(len(counts)):
        cmd = [sys.executable, __file__, "--nproc-per-node", ",".join(map(str, counts)), "--node-rank", str(node),
               "--master-addr", "127.0.0.1", "--master-port", str(port), "--steps", str(args.steps),
               "--timeout", str(args.timeout), "--backend", args.backend]
        env = dict(os.environ)
        if gpus and enough:  # this machine's GPUs, numbered from 0 inside it, as on a real one
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[sum(counts[:node]):sum(counts[:node + 1])])
        cmd += ["--device", args.device if enough or not gpus else "cpu"]
        print(f"machine {node}: {' '.join(cmd[1:])}", flush=True)
        # a session of its own: stopping a "machine" below stops its spawned workers too (its process group)
        procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
    deadline = time.time() + args.timeout + 120
    while any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs) or time.time() > deadline:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGTERM)
            for p in procs:
                p.wait()
            print("a machine failed (or the job ran too long): stopped the others", flush=True)
            return 1
        time.sleep(0.1)
    return 0 if all(p.returncode == 0 for p in procs) else 1


def _visible_gpus() -> list[str]:
    count = common.usable_gpus()
    named = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    return (named or [str(i) for i in range(count)])[:count]


def counts_of(text: str) -> list[int]:
    """--nproc-per-node: one count, or one per machine (2,1)."""
    try:
        counts = [int(c) for c in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected whole numbers of at least 1, like 2 or 2,1; got {text!r}")
    return counts


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc-per-node", "--nproc_per_node", type=counts_of, default="2",
                        help="processes on each machine: one number for all, or a list like 2,1 (default 2)")
    parser.add_argument("--nnodes", type=int, help="machines, when --nproc-per-node is one number")
    parser.add_argument("--world-size", "--world_size", type=int,
                        help="optional: the job's size, checked against the counts (or, with one count, it gives "
                             "the number of machines)")
    parser.add_argument("--node-rank", "--node_rank", type=int, help="this machine's number, 0 .. machines-1")
    parser.add_argument("--master-addr", "--master_addr", default="127.0.0.1", help="machine 0's address")
    parser.add_argument("--master-port", "--master_port", type=int, help="a free port on machine 0")
    parser.add_argument("--simulate-nodes", action="store_true", help="run every machine's command here")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    counts = args.nproc_per_node
    if len(counts) == 1:
        nnodes = args.nnodes or (args.world_size // counts[0] if args.world_size else 1)
        counts = counts * nnodes
    if args.world_size and args.world_size != sum(counts):
        parser.error(f"--world-size {args.world_size} but the machines' processes add up to {sum(counts)} "
                     f"({'+'.join(map(str, counts))})")
    if args.simulate_nodes:
        sys.exit(simulate(counts, args))
    if args.node_rank is None or not 0 <= args.node_rank < len(counts) or args.master_port is None:
        parser.error(f"give --node-rank (0 .. {len(counts) - 1}) and --master-port, or --simulate-nodes")
    os.environ["MASTER_ADDR"] = args.master_addr  # DDP: where rank 0 listens; every process of every machine
    os.environ["MASTER_PORT"] = str(args.master_port)
    first = rank_of(counts, args.node_rank, 0)
    plan = f"{len(counts)} machine(s) of {'+'.join(map(str, counts))} process(es) = {sum(counts)}"
    print(f"plan: {plan}; this is machine {args.node_rank}, ranks {first}..{first + counts[args.node_rank] - 1}\n",
          end="", flush=True)  # one write: the machines print at once
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does: N processes x all cores would fight
    try:
        mp.spawn(worker, args=(counts, args), nprocs=counts[args.node_rank], join=True)  # this machine's share
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
        joined = re.search(r"(\d+)/(\d+) clients joined", str(err))
        if joined or "DistStoreError" in str(err):  # the other machines never came: often not the plan meant
            who = f"only {joined.group(1)} of {joined.group(2)}" if joined else f"not all {sum(counts)}"
            sys.exit(f"spawn_per_node: error: {who} processes joined within --timeout {args.timeout:g} s. The plan "
                     f"was {plan}; start every machine's command, or give each machine's real count with "
                     f"--nproc-per-node (two machines of 8: --nproc-per-node 8)")
        sys.exit(f"spawn_per_node: a worker failed, all stopped here.\n{err}")


if __name__ == "__main__":
    main()
