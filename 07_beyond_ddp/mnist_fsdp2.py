"""Step 7 of the MNIST chain: the training of step 3 with FSDP2 (fully_shard): every rank holds 1/N of every weight,
of its gradient and of its optimizer state. The data side and the process group's life are the chain's.

With --checkpoint-dir DIR it saves DIR/mnist_fsdp2/ after every epoch: the sharded checkpoint (each rank writes
its own shards; a run continues from it at any number of processes) and model.pt, the full weights of the same
epoch as a plain state_dict of common.ConvNet().

    torchrun --standalone --nproc-per-node 2 07_beyond_ddp/mnist_fsdp2.py --checkpoint-dir runs/fsdp
    torchrun --standalone --nproc-per-node 3 07_beyond_ddp/mnist_fsdp2.py --checkpoint-dir runs/fsdp --epochs 3
    make fsdp NPROC=2                          # checks the arguments and any checkpoint first, then torchrun
"""

import argparse
import gc
import math
import os
import shutil
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as dsd
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
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
    batches = math.ceil(len(test_set) / world_size / 1000)  # FSDP: as many on every rank: each forward all-gathers
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world_size)),
                             batch_size=math.ceil(len(test_set) / world_size / batches))

    with torch.device("meta"):  # FSDP: shapes only, no memory yet: each rank will allocate only its shards
        model = common.ConvNet()
    mesh = init_device_mesh(device.type, (world_size,))  # FSDP: the ranks to shard over (the default group)
    bf16 = args.bf16 == "on" or (args.bf16 == "auto" and device.type == "cuda"
                                 and torch.cuda.is_bf16_supported(including_emulation=False))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
    for norm in (model.layer1[1], model.layer2[1]):  # FSDP: BatchNorm stays float32, as its running statistics
        fully_shard(norm, mesh=mesh)
    for block in (model.layer1, model.layer2):  # FSDP: a unit per block (its BatchNorm is a unit of its own)
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)  # FSDP: the root takes the rest (fc) and drives the others
    model.to_empty(device=device)  # FSDP: this rank's shards and the buffers, allocated, not yet initialised
    # FSDP: fully_shard copies no weights (DDP does): each rank keeps its shard of rank 0's model, and its buffers
    full = common.ConvNet().state_dict() if rank == 0 else {}  # whole, in rank 0's host memory
    dsd.set_model_state_dict(model, full, options=dsd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    path = os.path.join(args.checkpoint_dir, "mnist_fsdp2") if args.checkpoint_dir else ""
    if path and rank == 0 and os.path.exists(path + ".old") and not os.path.exists(path):
        os.replace(path + ".tmp", path)  # a crash came between the two renames below: .tmp is whole, finish the swap
    dist.barrier()  # no rank looks for the checkpoint before that
    start_epoch = 0
    if path and os.path.exists(path):  # continue a run: every rank reads the same checkpoint
        model_sd, optim_sd = dsd.get_state_dict(model, optimizer)  # FSDP: this rank's shards, to fill in
        state = {"model": model_sd, "optimizer": optim_sd, "epoch": 0}
        dcp.load(state, checkpoint_id=path)  # in place
        dsd.set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
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
            loss.backward()  # FSDP: reduce-scatters each unit's gradients as its backward ends: 1/N each
            optimizer.step()
            train_sums[0] += loss.detach() * len(labels)  # on the device: no wait for the GPU here
            train_sums[1] += len(labels)
            if rank == 0 and args.log_every and (step + 1) % args.log_every == 0:
                print(f"step: epoch={epoch + 1} step={step + 1} loss={loss.item():.4f}")

        for buffer in model.buffers():  # DDP: rank 0's BatchNorm statistics everywhere (see README)
            dist.broadcast(buffer, src=0)
        # sums over this rank's part of the test set, and over its training batches
        totals = torch.cat([common.evaluate(model, test_loader, device), train_sums])
        dist.all_reduce(totals)  # DDP: the sums of all ranks, on every rank: one all_reduce for every metric
        correct, samples, loss_sum, train_loss_sum, trained = totals.tolist()
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: train_loss={train_loss_sum / trained:.4f} "
                  f"test_loss={loss_sum / samples:.4f} test_acc={correct / samples:.4f}")
        if path:  # FSDP: every rank writes its own shards (a collective) into a new folder; rank 0 swaps it in
            model_sd, optim_sd = dsd.get_state_dict(model, optimizer)
            dcp.save({"model": model_sd, "optimizer": optim_sd, "epoch": epoch + 1}, checkpoint_id=path + ".tmp")
            full = dsd.get_model_state_dict(model, options=dsd.StateDictOptions(full_state_dict=True, cpu_offload=True))
            if rank == 0:  # the full weights go into the same folder: both are always of one epoch
                torch.save(full, os.path.join(path + ".tmp", "model.pt"))
                shutil.rmtree(path + ".old", ignore_errors=True)
                if os.path.exists(path):  # a folder cannot replace another in one step: the old one moves aside
                    os.replace(path, path + ".old")
                os.replace(path + ".tmp", path)
                shutil.rmtree(path + ".old", ignore_errors=True)
            dist.barrier()  # no rank reads or writes the folder before it is in place
    if rank == 0 and start_epoch < args.epochs:
        print(f"final: test_acc={correct / samples:.4f} test_samples={int(samples)} world_size={world_size} "
              f"epochs={args.epochs} seconds={time.time() - start:.1f} dataset={args.dataset}")


@record  # torchrun: on failure, its summary shows this worker's real traceback
def main():
    parser = argparse.ArgumentParser(description="MNIST with FSDP2 (fully_shard), started by torchrun.")
    parser.add_argument("--bf16", default="auto", choices=("auto", "on", "off"), help="auto: on a GPU that has it")
    parser.add_argument("--local-rank", "--local_rank", type=int, help="passed by the deprecated launcher; unused")
    args = common.add_training_flags(parser).parse_args()
    # DDP: torchrun tells each process its place: RANK among all, LOCAL_RANK among those on this node
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_world_size = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    device, backend = common.device_and_backend(args.device, args.backend, local_rank, local_world_size)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # DDP: this process's GPU; every later CUDA and NCCL call uses it
    # DDP: env:// reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; NCCL gets this process's GPU
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout),
                            device_id=device if backend == "nccl" else None)
    try:
        if local_rank == 0:  # one process per node downloads or writes the data ...
            common.prepare_data(args.dataset, args.data_dir)
        dist.barrier()  # DDP: ... while the others wait here (run `make data` first for a slow download)
        args.dataset = common.prepare_data(args.dataset, args.data_dir, download=False)  # which one `auto` took
        if rank == 0:
            print(f"{world_size} processes, {local_world_size} on this node, on {device.type} with {backend}")
        train(args, device, rank, world_size)
    finally:
        gc.collect()  # a workaround, not DDP: free the model (it lives in reference cycles) before its group
        dist.destroy_process_group()  # DDP: leave the group, also after an error


if __name__ == "__main__":
    main()
