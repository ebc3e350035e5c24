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


def global_rank(parser, args) -> tuple[int, int, int]:
    """(rank, local rank, processes per node): rank = node_rank * nproc_per_node + local_rank, or --rank as given."""
    nproc = args.nproc_per_node or (args.world_size if args.rank is not None else 0)  # --rank alone: one machine
    if args.rank is None and (args.node_rank is None or args.local_rank is None or not 0 <= args.local_rank < nproc):
        parser.error("give --rank, or --node-rank with --nproc-per-node and --local-rank (0 .. nproc-per-node - 1)")
    rank = args.rank if args.rank is not None else args.node_rank * nproc + args.local_rank
    return rank, args.local_rank if args.local_rank is not None else rank % nproc, nproc


def main():
    parser = common.training_parser(__doc__)
    parser.add_argument("--init-method", "--init_method", required=True,
                        help="tcp://RANK0_IP:PORT or file:///shared/new-file")
    parser.add_argument("--world-size", "--world_size", type=common.positive_int, required=True,
                        help="processes in the whole job")
    parser.add_argument("--rank", "-r", type=int, help="this process's global rank (or use --node-rank)")
    parser.add_argument("--node-rank", "--node_rank", type=int, help="this machine's number, 0 .. nodes-1")
    parser.add_argument("--local-rank", "--local_rank", "-g", "--gpuid", type=int,
                        help="this process's number (and GPU) on its machine")
    parser.add_argument("--nproc-per-node", "--nproc_per_node", type=common.positive_int,
                        help="processes on each machine (default with --rank: all on this one)")
    args = parser.parse_args()
    # DDP: no launcher: each process is told on its command line where to meet and its place in the job
    rank, local_rank, procs_per_node = global_rank(parser, args)
    world_size = args.world_size
    device, backend = common.check_args(parser, args, rank=rank, world_size=world_size, local_rank=local_rank,
                                        procs_per_node=procs_per_node)
    common.print0(rank, common.runtime_report(device, backend, procs_per_node))
    workarounds.stop_with_launcher()  # workaround: a killed launcher takes this worker with it
    if device.type == "cuda":
        torch.cuda.set_device(device)  # DDP: this process's GPU; every later CUDA and NCCL call uses it
    else:
        common.share_cpu_threads(procs_per_node)  # DDP: share the cores, unless OMP_NUM_THREADS is already set
    timeout, device_id = timedelta(seconds=args.timeout), device if backend == "nccl" else None  # DDP: NCCL binds it
    try:  # DDP: rank 0 listens at the tcp:// address (or creates the file); the others connect (or open it)
        dist.init_process_group(backend, init_method=args.init_method, rank=rank, world_size=world_size,
                                timeout=timeout, device_id=device_id)
    except (dist.DistNetworkError, dist.DistStoreError) as err:  # the two usual failures, in one line each
        why = ("Rank 0: is the port taken by another program? Others: is rank 0 running and reachable?"
               if isinstance(err, dist.DistNetworkError) else f"the group did not form within --timeout "
               f"{args.timeout:g} s. Start all {world_size} processes with the same --init-method and check that "
               f"rank 0's address is reachable.")
        sys.exit(f"error: rank {rank} at {args.init_method}: {str(err).splitlines()[0].rstrip('.')}. {why}")
    try:
        # DDP: one process PER NODE prepares the data (another node may not share this file system); a download
        # may outlast --timeout, so the others wait on a Gloo side group with a timeout of its own
        data_ready = dist.new_group(backend="gloo", timeout=timedelta(minutes=30))
        if local_rank == 0:
            args.dataset = common.prepare_data(args.dataset, args.data_dir)
        dist.barrier(group=data_ready)  # DDP: the others wait here until the data is ready
        args.dataset = common.resolve_dataset(args.dataset, args.data_dir)
        common.say(f"rank {rank} (node {rank // procs_per_node}, local rank {local_rank}) of {world_size} joined "
                   f"via {args.init_method.split(':')[0]} on {socket.gethostname()}")
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
