"""Step 3 of the MNIST chain: the same DDP training, started by torchrun instead of mp.spawn.

torchrun starts the processes (on one node or many) and tells each its RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT through the environment: init_process_group needs no address. It can also
restart the whole group when a worker fails; with --checkpoint-dir the script then continues from the last
finished epoch by itself.

    torchrun --standalone --nproc-per-node 2 03_ddp_torchrun/mnist_torchrun.py
    torchrun --standalone --nproc-per-node 2 --max-restarts 1 03_ddp_torchrun/mnist_torchrun.py \\
        --checkpoint-dir runs/elastic --simulate-failure-at-step 250        # crash once, recover
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-addr 10.0.0.1 --master-port 29500 \\
        03_ddp_torchrun/mnist_torchrun.py                                   # node 0 of 2; node 1: --node-rank 1
    python -m torch.distributed.launch --nproc-per-node 2 03_ddp_torchrun/mnist_torchrun.py   # deprecated
    make ddp-torchrun NPROC=2

Next steps: 04_multinode_tcp/mnist_tcp.py starts every process by hand with a tcp:// address;
06_amp_syncbn/mnist_amp_syncbn.py adds mixed precision and SyncBatchNorm.
"""

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
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # torchrun: 0 on the first attempt
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
            if restart == 0 and rank == args.fail_rank and epoch * steps + step + 1 == args.simulate_failure_at_step:
                raise RuntimeError(f"simulated failure of rank {rank} at step {step + 1} of epoch {epoch + 1}")

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
        seconds=time.time() - start, dataset=args.dataset, weights=digests[0], ranks_agree=len(set(digests)) == 1,
        restarts=restart))


@record  # torchrun: on failure, its summary shows this worker's real traceback
def main():
    parser = common.training_parser(__doc__)
    common.accept_local_rank(parser)  # the deprecated torch.distributed.launch passes --local-rank
    parser.add_argument("--simulate-failure-at-step", type=common.count_or_zero, default=0,
                        help="demo: --fail-rank crashes at this step (counted over epochs), on the first attempt")
    parser.add_argument("--fail-rank", type=int, default=1, help="the rank that crashes (default %(default)s)")
    args = parser.parse_args()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        parser.error(f"start me with torchrun, e.g. torchrun --standalone --nproc-per-node 2 {__file__}")
    # DDP: torchrun says who we are: RANK in the job, LOCAL_RANK on this node, and how many we are
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    procs_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    device, backend = common.check_args(parser, args, rank=rank, world_size=world_size, local_rank=local_rank,
                                        procs_per_node=procs_per_node)
    common.print0(rank, common.runtime_report(device, backend, procs_per_node))
    workarounds.stop_with_launcher()  # workaround: a killed launcher takes this worker with it
    if device.type == "cuda":
        torch.cuda.set_device(device)  # DDP: this process's GPU; every later CUDA and NCCL call uses it
    else:
        common.share_cpu_threads(procs_per_node)  # DDP: share the cores, unless OMP_NUM_THREADS is already set
    timeout, device_id = timedelta(seconds=args.timeout), device if backend == "nccl" else None  # DDP: NCCL binds it
    if workarounds.restarts_possible():  # torchrun --max-restarts: see workarounds.py
        workarounds.join_group_per_attempt(backend, timeout, device_id)
    else:
        dist.init_process_group(backend, timeout=timeout, device_id=device_id)  # DDP: env://, torchrun's variables
    try:
        # DDP: one process PER NODE prepares the data (another node may not share this file system); a download
        # may outlast --timeout, so the others wait on a Gloo side group with a timeout of its own
        data_ready = dist.new_group(backend="gloo", timeout=timedelta(minutes=30))
        if local_rank == 0:
            args.dataset = common.prepare_data(args.dataset, args.data_dir)
        dist.barrier(group=data_ready)  # DDP: the others wait here until the data is ready
        args.dataset = common.resolve_dataset(args.dataset, args.data_dir)
        common.print0(rank, f"torchrun gave {world_size} processes, {procs_per_node} on this node; "
                            f"restart {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
        train(args, device, rank, world_size)
        dist.barrier()  # DDP: every rank finishes its work before any tears the group down
    except common.UsageError as err:
        parser.error(str(err))
    finally:
        workarounds.free_ddp_models()  # workaround: free DDP objects before the group goes, or exit can abort
        dist.destroy_process_group()  # DDP: leave the group, also after an error
    workarounds.leave()  # workaround: os._exit, as Gloo's teardown at exit can abort a finished run


if __name__ == "__main__":
    main()
