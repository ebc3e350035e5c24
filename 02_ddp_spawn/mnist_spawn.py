"""Step 2 of the MNIST chain: DistributedDataParallel, one process per device, started by mp.spawn.

The parent prepares the data, picks a free port and puts rank 0's address in MASTER_ADDR/MASTER_PORT; then
mp.spawn starts --nproc copies of main_worker(). Each joins the process group (env://, as the source notes do
it), wraps its model in DDP, trains on its own shard of the data, and all of them evaluate together on disjoint
parts of the test set.

    python 02_ddp_spawn/mnist_spawn.py --nproc 2               # CPU + Gloo, or one GPU each + NCCL
    python 02_ddp_spawn/mnist_spawn.py --nproc 2 --checkpoint-dir runs/spawn --epochs 1
    python 02_ddp_spawn/mnist_spawn.py --nproc 2 --checkpoint-dir runs/spawn --epochs 2   # continues
    make ddp-spawn NPROC=2

mp.spawn starts processes on one machine only; for several machines see 03_ddp_torchrun and 04.
Next step: 03_ddp_torchrun/mnist_torchrun.py lets torchrun start the processes instead.
"""

import os
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
import workarounds


def train(args, device, rank=0, world_size=1):
    common.seed_everything(args.seed)
    train_set = common.load_dataset(args.dataset, args.data_dir, train=True)
    test_set = common.load_dataset(args.dataset, args.data_dir, train=False)
    # DDP: each rank its own shard; one shared permutation per epoch, cut into world_size disjoint parts
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_loader = common.batch_loader(train_set, args.batch_size, sampler=sampler, pin_memory=device.type == "cuda")
    # DDP: exact evaluation, rank r takes test images r, r+world_size, ...: disjoint, nothing padded
    test_loader = common.batch_loader(test_set, 1000, sampler=range(rank, len(test_set), world_size))

    model = common.ConvNet().to(device)
    # DDP: copies rank 0's weights to every rank now, then averages the gradients in every backward()
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # a checkpoint in --checkpoint-dir is continued; one of another run is refused, in one line
    path = Path(args.checkpoint_dir) / f"{Path(__file__).stem}.pt" if args.checkpoint_dir else None
    run = {"script": Path(__file__).name, "model": "ConvNet", "dataset": args.dataset}
    state, start_epoch = common.resume_state(path, run), 0
    if state:
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        common.set_rng_state(state["rng"])
        start_epoch = state["epoch"]
        common.print0(rank, f"resumed from {path} after epoch {start_epoch}{common.use_lr(optimizer, args.lr)}")

    common.print0(rank, f"training ConvNet on {args.dataset} ({len(train_set)} train / {len(test_set)} test "
                        f"images) with {world_size} process(es) on {device.type}, batch {args.batch_size} per "
                        f"process, {args.epochs} epoch(s)")
    start = time.time()
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # DDP: a new order every epoch, the same permutation on every rank
        if args.show_shards:
            common.say(common.shard_line(rank, epoch, sampler))
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
            loss.backward()  # DDP: all-reduces the gradients here, bucket by bucket, while backward runs
            optimizer.step()
            if args.log_every and (step + 1) % args.log_every == 0:
                common.print0(rank, common.line("step", epoch=epoch + 1, step=step + 1, loss=loss.item()))

        for buffer in model.module.buffers():  # DDP: rank 0's BatchNorm statistics everywhere (see README)
            dist.broadcast(buffer, src=0)
        totals = common.evaluate(model.module, test_loader, device)  # sums over this rank's part of the test set
        dist.all_reduce(totals)  # DDP: the sums of all ranks, on every rank
        correct, samples, loss_sum = totals.tolist()
        common.print0(rank, common.line("epoch", epoch=epoch + 1, epochs=args.epochs, train_loss=loss.item(),
                                        test_loss=loss_sum / samples, test_acc=correct / samples))
        if rank == 0 and path:  # DDP: one writer is enough, every rank holds the same weights
            common.save_checkpoint(path, run, model=model.module.state_dict(), optimizer=optimizer.state_dict(),
                                   epoch=epoch + 1, rng=common.rng_state(), device=device.type)

    if start_epoch >= args.epochs:
        common.print0(rank, f"nothing to do: the checkpoint is already at epoch {start_epoch} of {args.epochs}")
        return
    digests = [None] * world_size
    dist.all_gather_object(digests, common.weights_digest(model.module))  # DDP: do all ranks hold the same?
    common.print0(rank, common.final_line(
        test_acc=correct / samples, test_samples=int(samples), world_size=world_size, epochs=args.epochs,
        seconds=time.time() - start, dataset=args.dataset, weights=digests[0], ranks_agree=len(set(digests)) == 1))


def main():
    parser = common.training_parser(__doc__)
    parser.add_argument("--nproc", type=common.positive_int, default=2, help="processes to start")
    args = parser.parse_args()
    device, backend = common.check_args(parser, args, procs_per_node=args.nproc)  # checked once, in the parent
    common.print0(0, common.runtime_report(device, backend, args.nproc))
    try:
        args.dataset = common.prepare_data(args.dataset, args.data_dir)  # once, before any training starts
        os.environ["MASTER_ADDR"] = "127.0.0.1"  # DDP: mp.spawn's workers all run on this machine
        os.environ["MASTER_PORT"] = str(common.free_port())  # DDP: a free port now; a fixed one may be taken
        mp.spawn(main_worker, args=(args.nproc, args), nprocs=args.nproc, join=True)  # DDP: rank = 0 .. nproc-1
    except common.UsageError as err:
        parser.error(str(err))
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:  # mp.spawn stopped the others
        sys.exit(f"mnist_spawn: a worker failed, all stopped.\n{common.worker_error(err)}")


def main_worker(rank, world_size, args):
    """The life of one process: join the group, train, leave it. mp.spawn passes the rank first."""
    device, backend = common.choose_device(args.device, args.backend, local_rank=rank, procs_per_node=world_size)
    workarounds.stop_with_launcher()  # workaround: a killed launcher takes this worker with it
    if device.type == "cuda":
        torch.cuda.set_device(device)  # DDP: this process's GPU; every later CUDA and NCCL call uses it
    else:
        common.share_cpu_threads(world_size)  # DDP: share the cores, unless OMP_NUM_THREADS is already set
    timeout, device_id = timedelta(seconds=args.timeout), device if backend == "nccl" else None  # DDP: NCCL binds it
    # DDP: env://, rank 0 listens at MASTER_ADDR:MASTER_PORT and the others connect there
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, device_id=device_id)
    try:
        train(args, device, rank, world_size)
        dist.barrier()  # DDP: every rank finishes its work before any tears the group down
    finally:
        workarounds.free_ddp_models()  # workaround: free DDP objects before the group goes, or exit can abort
        dist.destroy_process_group()  # DDP: leave the group, also after an error
    workarounds.leave()  # workaround: os._exit, as Gloo's teardown at exit can abort a finished run


if __name__ == "__main__":
    main()
