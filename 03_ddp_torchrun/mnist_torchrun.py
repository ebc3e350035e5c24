"""Step 4 of the MNIST chain: the same DDP training, started by torchrun instead of mp.spawn.

torchrun starts the processes (on one node or many), and tells each its RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT through the environment: init_method="env://". It can
also restart the whole group when a worker fails; with --checkpoint-dir the script then resumes
from the last finished epoch by itself.

    torchrun --standalone --nproc-per-node 2 03_ddp_torchrun/mnist_torchrun.py
    torchrun --standalone --nproc-per-node 2 --max-restarts 1 03_ddp_torchrun/mnist_torchrun.py \\
        --checkpoint-dir runs/elastic --simulate-failure-at-step 250        # crash once, recover
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-addr 10.0.0.1 --master-port 29500 \\
        03_ddp_torchrun/mnist_torchrun.py                                   # node 0 of 2; node 1: --node-rank 1
    python -m torch.distributed.launch --nproc-per-node 2 03_ddp_torchrun/mnist_torchrun.py   # deprecated
    make ddp-torchrun NPROC=2

Next step: 04_multinode_tcp/mnist_tcp.py starts every process by hand with a tcp:// address.
"""

import argparse
import gc
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

import common


def join_group(args, backend, device, rank, world_size):
    """init_process_group from torchrun's environment, in a fresh namespace for every restart.

    torchrun's agent keeps one key-value store for the whole job. Workers restarted after a
    failure find the failed attempt's keys (its Gloo addresses) still there and may connect to
    dead processes. A PrefixStore named after TORCHELASTIC_RESTART_COUNT gives each attempt its own keys.
    """
    timeout = timedelta(seconds=args.timeout)
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"attempt_{attempt}", store), rank=rank,
                            world_size=world_size, timeout=timeout,
                            device_id=device if backend == "nccl" else None)  # NCCL: bind this GPU now


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
    path = Path(args.checkpoint_dir) / "mnist_torchrun.pt" if args.checkpoint_dir else None
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
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # 0 = first attempt
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
            if (restart == 0 and rank == args.fail_rank
                    and epoch * steps + step + 1 == args.simulate_failure_at_step):  # demo: crash once
                raise RuntimeError(f"simulated failure of rank {rank} at step {step + 1} of epoch {epoch + 1}")

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
            epochs=args.epochs, seconds=time.time() - start, dataset=dataset, restarts=restart))


@record  # on failure, torchrun's summary shows this worker's real traceback
def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(parser)
    parser.add_argument("--local-rank", "--local_rank", type=int, default=-1, dest="local_rank",
                        help="set by the deprecated torch.distributed.launch; LOCAL_RANK wins when set")
    parser.add_argument("--simulate-failure-at-step", type=int, default=0,
                        help="demo: --fail-rank raises at this step (counted over epochs), first attempt only")
    parser.add_argument("--fail-rank", type=int, default=1, help="the rank that fails (default %(default)s)")
    args = parser.parse_args()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        parser.error("start me with torchrun, e.g. torchrun --standalone --nproc-per-node 2 " + __file__)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    if not 0 <= rank < world_size or local_rank < 0:
        parser.error(f"RANK={rank} with WORLD_SIZE={world_size}, LOCAL_RANK={local_rank}: "
                     f"ranks must run from 0 to WORLD_SIZE-1")
    procs_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    device, backend = common.check_args(parser, args, local_rank=local_rank, procs_per_node=procs_per_node)
    common.print0(rank, common.runtime_report(device, backend, procs_per_node))
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init: this process's GPU for every CUDA and NCCL call

    join_group(args, backend, device, rank, world_size)
    try:
        # One process PER NODE prepares the data: local_rank 0 exists once on every node (rank 0 only once
        # in the job), and another node may not share this file system. A first download can take longer
        # than --timeout, so the others wait at a barrier of a Gloo group with a long timeout of its own.
        data_ready = dist.new_group(backend="gloo", timeout=timedelta(minutes=30))
        if local_rank == 0:
            args.dataset = common.prepare_data(args.dataset, args.data_dir)
        dist.barrier(group=data_ready)
        args.dataset = common.resolve_dataset(args.dataset, args.data_dir)
        common.print0(rank, f"torchrun gave {world_size} processes, {procs_per_node} on this node; "
                            f"restart {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
        train(rank, world_size, args, device)
        dist.barrier()  # every rank finishes its work before any tears the group down
    finally:
        gc.collect()  # free the DDP model (it sits in reference cycles) while the group still exists
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    common.leave()  # skip the interpreter teardown that can abort (see common.leave)
