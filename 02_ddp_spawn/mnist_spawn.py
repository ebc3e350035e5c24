"""Step 3 of the MNIST chain: DistributedDataParallel, one process per device, started by mp.spawn.

The parent prepares the data and picks a free port, then mp.spawn starts --nproc copies of
train(). Each joins the process group, wraps its model in DDP, trains on its own shard of the
data (DistributedSampler), and all of them evaluate together on disjoint parts of the test set.

    python 02_ddp_spawn/mnist_spawn.py --nproc 2               # CPU + Gloo, or one GPU each + NCCL
    python 02_ddp_spawn/mnist_spawn.py --nproc 2 --checkpoint-dir checkpoints --epochs 1
    python 02_ddp_spawn/mnist_spawn.py --nproc 2 --checkpoint-dir checkpoints --epochs 2 --resume
    make ddp-spawn NPROC=2

mp.spawn starts processes on one machine only; for several machines see 03_ddp_torchrun and 04.
Next step: 03_ddp_torchrun/mnist_torchrun.py lets torchrun start the processes instead.
"""

import argparse
import gc
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

import common


def main_worker(rank, world_size, args, port):
    """The life of one process: join the group, train, leave the group. mp.spawn passes the rank first."""
    device, backend = common.choose_device(args.device, args.backend, local_rank=rank, procs_per_node=world_size)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this process's GPU: every later .cuda() and NCCL call uses it
    else:
        common.share_cpu_threads(world_size)  # N processes on one machine share its cores
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=args.timeout),
                            device_id=device if backend == "nccl" else None)  # NCCL: bind this GPU now
    try:
        train(rank, world_size, args, device)
        dist.barrier()  # every rank finishes its work before any tears the group down
    finally:
        gc.collect()  # free the DDP model (it sits in reference cycles) while the group still exists
        dist.destroy_process_group()
    common.leave()  # skip the interpreter teardown that can abort (see common.leave)


def train(rank, world_size, args, device):
    common.seed_everything(args.seed)
    dataset = args.dataset  # the parent prepared it before spawning: no download per rank
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
    path = Path(args.checkpoint_dir) / "mnist_spawn.pt" if args.checkpoint_dir else None
    start_epoch = 0
    if args.resume and path and path.exists():
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(parser)
    parser.add_argument("--nproc", type=common.positive_int, default=2, help="processes to start (default %(default)s)")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint in --checkpoint-dir")
    args = parser.parse_args()
    device, backend = common.check_args(parser, args, procs_per_node=args.nproc)  # checked once, here
    print(common.runtime_report(device, backend, args.nproc), flush=True)
    if args.resume and not args.checkpoint_dir:
        parser.error("--resume needs --checkpoint-dir")
    try:
        args.dataset = common.prepare_data(args.dataset, args.data_dir)  # once, before any worker starts
    except common.UsageError as err:
        parser.exit(2, f"error: {err}\n")
    port = common.free_port()  # picked now, bound by rank 0 a moment later; a fixed port can be taken
    try:
        mp.spawn(main_worker, args=(args.nproc, args, port), nprocs=args.nproc, join=True)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:  # mp.spawn stopped the others
        sys.exit(f"mnist_spawn: a worker failed, all stopped.\n{err}")


if __name__ == "__main__":
    main()
