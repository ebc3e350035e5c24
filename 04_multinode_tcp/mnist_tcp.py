"""Step 5 of the MNIST chain: no launcher. Every process is started by hand and told where to meet.

Each process gets the address of rank 0 (--init-method tcp://IP:PORT, or a shared file with
file://PATH), the world size, and its own rank: either --rank directly, or --node-rank and
--local-rank, from which rank = node_rank * nproc_per_node + local_rank.

    # one machine, two processes, two terminals:
    python 04_multinode_tcp/mnist_tcp.py --init-method tcp://127.0.0.1:23456 --world-size 2 --rank 0
    python 04_multinode_tcp/mnist_tcp.py --init-method tcp://127.0.0.1:23456 --world-size 2 --rank 1
    # two machines, two processes each; node 0 is 10.0.0.1 (four commands, local ranks 0 and 1 on each node):
    python 04_multinode_tcp/mnist_tcp.py --init-method tcp://10.0.0.1:23456 --world-size 4 \\
        --nproc-per-node 2 --node-rank 0 --local-rank 0        # ... --node-rank 1 --local-rank 1 on node 1
    # a file on a shared file system instead of an address (it must not exist yet):
    python 04_multinode_tcp/mnist_tcp.py --init-method file:///shared/ddp-init-job42 --world-size 2 --rank 0
    make multinode-tcp NNODES=2 NPROC=2        # 2 "nodes" x 2 processes on this machine
    make multinode-file NNODES=2 NPROC=2

Next step: 06_amp_syncbn/mnist_amp_syncbn.py adds mixed precision and SyncBatchNorm.
"""

import argparse
import gc
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

import common


def train(rank, world_size, args, device):
    common.seed_everything(args.seed)
    dataset = args.dataset
    train_set = common.load_dataset(dataset, args.data_dir, train=True)
    test_set = common.load_dataset(dataset, args.data_dir, train=False)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_loader = common.batch_loader(train_set, args.batch_size, sampler=sampler,
                                       pin_memory=device.type == "cuda")
    # exact evaluation: rank r takes test images r, r+world_size, ...: disjoint, no padding
    test_loader = common.batch_loader(test_set, 1000, sampler=range(rank, len(test_set), world_size))

    model = common.ConvNet().to(device)
    # DDP broadcasts rank 0's weights to all ranks, then averages gradients during backward()
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    path = Path(args.checkpoint_dir) / "mnist_tcp.pt" if args.checkpoint_dir else None
    start_epoch = 0
    if path and path.exists():  # resume automatically: a restarted job continues where it stopped
        state = common.load_checkpoint(path)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        common.set_rng_state(state["rng"])
        start_epoch = state["epoch"]
        common.print0(rank, f"resumed from {path} after epoch {start_epoch}")

    common.print0(rank, f"training ConvNet on {dataset} ({len(train_set)} train / {len(test_set)} test "
                        f"images) with {world_size} processes ({dist.get_backend()}, {device.type}), "
                        f"batch {args.batch_size} per process, {args.epochs} epoch(s)")
    start = time.time()
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle every epoch, the same permutation on every rank
        model.train()
        steps = min(len(train_loader), args.max_steps or len(train_loader))
        bar = common.progress(train_loader, rank, desc=f"epoch {epoch + 1}/{args.epochs}", total=steps)
        for step, (images, labels) in enumerate(bar):
            if step == steps:
                break
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces the gradients here, bucket by bucket
            optimizer.step()
            if args.log_every and (step + 1) % args.log_every == 0:
                common.print0(rank, f"epoch {epoch + 1} step {step + 1}/{steps} loss={loss.item():.4f}")

        # BatchNorm running statistics differ per rank (each saw its own batches). DDP copies rank 0's
        # at the start of every forward, but evaluation bypasses the wrapper: copy them now
        for buffer in model.module.buffers():
            dist.broadcast(buffer, src=0)
        # every rank evaluates its part through model.module (no DDP hooks), then the sums are added
        totals = common.evaluate(model.module, test_loader, device)
        dist.all_reduce(totals)
        correct, samples, loss_sum = totals.tolist()
        common.print0(rank, f"epoch {epoch + 1}/{args.epochs}: train_loss={loss.item():.4f} (rank 0) "
                            f"test_loss={loss_sum / samples:.4f} test_acc={correct / samples:.4f}")
        if rank == 0 and path:  # the weights are identical on every rank: one writer is enough
            common.atomic_save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                                "epoch": epoch + 1, "rng": common.rng_state(), "device": device.type}, path)

    if start_epoch >= args.epochs:
        common.print0(rank, f"nothing to do: the checkpoint is already at epoch {start_epoch}")
    else:
        common.print0(rank, common.final_line(
            test_acc=correct / samples, test_samples=int(samples), world_size=world_size,
            epochs=args.epochs, seconds=time.time() - start, dataset=dataset))


def global_rank(parser, args):
    """rank = node_rank * nproc_per_node + local_rank, or --rank as given; refuse what cannot work."""
    if args.rank is None and args.node_rank is None:
        parser.error("give --rank, or --node-rank and --local-rank")
    if args.nproc_per_node is None:  # with --rank alone: all processes on this one machine
        if args.rank is None:
            parser.error("--node-rank needs --nproc-per-node (processes on each machine)")
        args.nproc_per_node = args.world_size
    if args.nproc_per_node < 1:
        parser.error("--nproc-per-node must be at least 1")
    if args.rank is not None:
        rank = args.rank
        local_rank = args.local_rank if args.local_rank is not None else rank % args.nproc_per_node
    else:
        if args.local_rank is None:
            parser.error("--node-rank needs --local-rank (0 .. nproc_per_node-1)")
        if not 0 <= args.local_rank < args.nproc_per_node:
            parser.error(f"--local-rank {args.local_rank} must be below --nproc-per-node {args.nproc_per_node}")
        rank = args.node_rank * args.nproc_per_node + args.local_rank
        local_rank = args.local_rank
    if not 0 <= rank < args.world_size:
        parser.error(f"rank {rank} is not below --world-size {args.world_size}: ranks run from 0 to "
                     f"{args.world_size - 1} (world size = nodes x processes per node)")
    if not args.init_method.startswith(("tcp://", "file://")):
        parser.error("--init-method must be tcp://HOST:PORT (rank 0's address) or file://PATH (a new file)")
    if args.init_method.startswith("file://"):
        path = Path(args.init_method[len("file://"):])
        if not path.parent.is_dir() or not os.access(path.parent, os.W_OK):  # FileStore would wait forever
            parser.error(f"{args.init_method}: the folder {path.parent} does not exist or is not writable")
        if path.exists() and time.time() - path.stat().st_mtime > 60:
            parser.error(f"{args.init_method} already exists, left by an earlier job: a file:// path must be "
                         f"new for every job (delete it or pick another name)")
    return rank, local_rank


def join_group(args, backend, device, rank):
    """init_process_group with the two usual failures turned into one line each."""
    try:
        # rank 0 listens at the tcp:// address (or creates the file); the others connect (or open it)
        dist.init_process_group(backend, init_method=args.init_method, rank=rank, world_size=args.world_size,
                                timeout=timedelta(seconds=args.timeout),
                                device_id=device if backend == "nccl" else None)  # NCCL: bind this GPU now
    except dist.DistNetworkError as err:
        sys.exit(f"error: rank {rank} cannot use {args.init_method}: {str(err).splitlines()[0].rstrip('.')}. "
                 f"Rank 0: is the port taken by another program? Others: is rank 0 running and reachable?")
    except dist.DistStoreError as err:
        sys.exit(f"error: rank {rank}: the group did not form within --timeout {args.timeout:g} s "
                 f"({str(err).splitlines()[0].rstrip('.')}). Start all {args.world_size} processes with the same "
                 f"--init-method and check that rank 0's address is reachable.")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(parser)
    parser.add_argument("--init-method", required=True, help="tcp://RANK0_IP:PORT or file:///shared/new-file")
    parser.add_argument("--world-size", type=int, required=True, help="processes in the whole job")
    parser.add_argument("--rank", type=int, help="this process's global rank (or use --node-rank)")
    parser.add_argument("--node-rank", type=int, help="this machine's number, 0 .. nodes-1")
    parser.add_argument("--local-rank", type=int, help="this process's number on its machine")
    parser.add_argument("--nproc-per-node", type=int,
                        help="processes on each machine (default with --rank: all on this one)")
    args = parser.parse_args()
    if args.world_size < 1:
        parser.error("--world-size must be at least 1")
    rank, local_rank = global_rank(parser, args)
    device, backend = common.check_args(parser, args, local_rank=local_rank, procs_per_node=args.nproc_per_node)
    common.print0(rank, common.runtime_report(device, backend, args.nproc_per_node))
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init: this process's GPU for every CUDA and NCCL call
    else:
        common.share_cpu_threads(args.nproc_per_node)

    join_group(args, backend, device, rank)
    try:
        # One process PER NODE prepares the data: local_rank 0 exists once on every node (rank 0 only once
        # in the job), and another node may not share this file system. A first download can take longer
        # than --timeout, so the others wait at a barrier of a Gloo group with a long timeout of its own.
        data_ready = dist.new_group(backend="gloo", timeout=timedelta(minutes=30))
        if local_rank == 0:
            args.dataset = common.prepare_data(args.dataset, args.data_dir)
        dist.barrier(group=data_ready)
        args.dataset = common.resolve_dataset(args.dataset, args.data_dir)
        common.say(f"rank {rank} (node {rank // args.nproc_per_node}, local rank {local_rank}) of "
                   f"{args.world_size} joined via {args.init_method.split(':')[0]} on {socket.gethostname()}")
        train(rank, args.world_size, args, device)
        dist.barrier()  # every rank finishes its work before any tears the group down
    finally:
        gc.collect()  # free the DDP model (it sits in reference cycles) while the group still exists
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    common.leave()  # skip the interpreter teardown that can abort (see common.leave)
