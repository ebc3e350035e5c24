"""Step 4 of the MNIST chain: no launcher. Every process is started by hand and told where to meet.

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

The source notes' spellings work too: --init_method, --world_size, -r, -g/--gpuid (the local rank).
"""

import argparse
import gc
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

import common


def train(args, device, rank, world_size):
    common.seed_everything(args.seed)
    train_set = common.load_dataset(args.dataset, args.data_dir, train=True)
    test_set = common.load_dataset(args.dataset, args.data_dir, train=False)
    # DDP: each rank its own shard; one shared permutation per epoch, cut into world_size disjoint parts
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, pin_memory=device.type == "cuda")
    # DDP: exact evaluation, rank r takes test images r, r+world_size, ...: disjoint, nothing padded
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world_size)), batch_size=1000)

    model = common.ConvNet().to(device)
    # DDP: copies rank 0's weights to every rank now, then averages the gradients in every backward()
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    path = os.path.join(args.checkpoint_dir, "mnist_tcp.pt") if args.checkpoint_dir else ""
    start_epoch = 0
    if path and os.path.exists(path):  # continue a run: every rank reads the same checkpoint
        state = torch.load(path, map_location=device, weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"]
        if rank == 0:
            print(f"resumed from {path} after epoch {start_epoch}")

    start = time.time()
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # DDP: a new order every epoch, the same permutation on every rank
        model.train()
        train_sums = torch.zeros(2, dtype=torch.float64, device=device)  # this rank's loss x samples, samples
        bar = tqdm(train_loader, desc=f"epoch {epoch + 1}", disable=None if rank == 0 else True)  # rank 0, a terminal
        for step, (images, labels) in enumerate(bar):
            if args.max_steps and step == args.max_steps:  # --max-steps: a short epoch (smoke runs, CI)
                break
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP: all-reduces the gradients here, bucket by bucket, while backward runs
            optimizer.step()
            train_sums[0] += loss.detach() * len(labels)  # on the device: no wait for the GPU here
            train_sums[1] += len(labels)
            if rank == 0 and args.log_every and (step + 1) % args.log_every == 0:
                print(f"step: epoch={epoch + 1} step={step + 1} loss={loss.item():.4f}")

        for buffer in model.module.buffers():  # DDP: rank 0's BatchNorm statistics everywhere (see README)
            dist.broadcast(buffer, src=0)
        # sums over this rank's part of the test set, and over its training batches
        totals = torch.cat([common.evaluate(model.module, test_loader, device), train_sums])
        dist.all_reduce(totals)  # DDP: the sums of all ranks, on every rank: one all_reduce for every metric
        correct, samples, loss_sum, train_loss_sum, trained = totals.tolist()
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: train_loss={train_loss_sum / trained:.4f} "
                  f"test_loss={loss_sum / samples:.4f} test_acc={correct / samples:.4f}")
        if rank == 0 and path:  # DDP: one writer is enough, every rank holds the same weights
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch + 1}
            os.makedirs(args.checkpoint_dir, exist_ok=True)
            torch.save(state, path + ".tmp")
            os.replace(path + ".tmp", path)  # a crash while saving leaves the last good checkpoint
    if rank == 0 and start_epoch < args.epochs:
        print(f"final: test_acc={correct / samples:.4f} test_samples={int(samples)} world_size={world_size} "
              f"epochs={args.epochs} seconds={time.time() - start:.1f} dataset={args.dataset}")


def main():
    parser = argparse.ArgumentParser(description="MNIST with DDP, every process started by hand.")
    parser.add_argument("--init-method", "--init_method", required=True, help="tcp://RANK0_IP:PORT or file://PATH")
    parser.add_argument("--world-size", "--world_size", type=int, required=True, help="processes in the whole job")
    parser.add_argument("--rank", "-r", type=int, help="this process's rank in the job (or --node-rank ...)")
    parser.add_argument("--node-rank", "--node_rank", type=int, default=0, help="this machine's number")
    parser.add_argument("--local-rank", "--local_rank", "-g", "--gpuid", type=int, help="the process's number here")
    parser.add_argument("--nproc-per-node", "--nproc_per_node", type=int, help="processes on each machine")
    args = common.add_training_flags(parser).parse_args()
    # DDP: no launcher: each process is told where to meet and its place, rank = node * per-node + local
    nproc = args.nproc_per_node or args.world_size
    rank = args.rank if args.rank is not None else args.node_rank * nproc + args.local_rank
    local_rank = args.local_rank if args.local_rank is not None else rank % nproc
    device, backend = common.device_and_backend(args.device, args.backend, local_rank, nproc)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # DDP: this process's GPU; every later CUDA and NCCL call uses it
    # DDP: rank 0 listens at the tcp:// address (or creates the file), the others connect (or open it)
    dist.init_process_group(backend, init_method=args.init_method, rank=rank, world_size=args.world_size,
                            timeout=timedelta(seconds=args.timeout), device_id=device if backend == "nccl" else None)
    try:
        if local_rank == 0:  # one process per node downloads or writes the data ...
            common.prepare_data(args.dataset, args.data_dir)
        dist.barrier()  # DDP: ... while the others wait here (run `make data` first for a slow download)
        args.dataset = common.prepare_data(args.dataset, args.data_dir, download=False)  # which one `auto` took
        print(f"rank {rank} (local rank {local_rank}) of {args.world_size} joined via {args.init_method}", flush=True)
        train(args, device, rank, args.world_size)
    finally:
        gc.collect()  # a workaround, not DDP: free the DDP model (it lives in reference cycles) before its group
        dist.destroy_process_group()  # DDP: leave the group, also after an error


if __name__ == "__main__":
    main()
