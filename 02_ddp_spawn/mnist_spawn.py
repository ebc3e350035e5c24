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

import argparse
import gc
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
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
    path = os.path.join(args.checkpoint_dir, "mnist_spawn.pt") if args.checkpoint_dir else ""
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
    parser = argparse.ArgumentParser(description="MNIST with DDP, processes started by mp.spawn.")
    parser.add_argument("--nproc", type=int, default=2, help="processes to start (default %(default)s)")
    args = common.add_training_flags(parser).parse_args()
    args.dataset = common.prepare_data(args.dataset, args.data_dir)  # download or write the data, once
    os.environ["MASTER_ADDR"] = "127.0.0.1"  # DDP: mp.spawn's workers all run on this machine
    os.environ["MASTER_PORT"] = str(common.free_port())  # DDP: a free port now; a fixed one may be taken
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does: N processes x all cores would fight
    mp.spawn(main_worker, args=(args.nproc, args), nprocs=args.nproc)  # DDP: rank = 0 .. nproc-1, first argument


def main_worker(rank, world_size, args):
    """The life of one process: join the group, train, leave it. mp.spawn passes the rank first."""
    device, backend = common.device_and_backend(args.device, args.backend, rank, world_size)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # DDP: this process's GPU; every later CUDA and NCCL call uses it
    # DDP: env://, rank 0 listens at MASTER_ADDR:MASTER_PORT and the others connect there
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=args.timeout),
                            device_id=device if backend == "nccl" else None)
    try:
        if rank == 0:
            print(f"{world_size} processes on {device.type} with {backend}")
        train(args, device, rank, world_size)
    finally:
        gc.collect()  # a workaround, not DDP: free the DDP model (it lives in reference cycles) before its group
        dist.destroy_process_group()  # DDP: leave the group, also after an error


if __name__ == "__main__":
    main()
