"""ResNet-18 on CIFAR-10 with DDP: augmentation, SGD with momentum and weight decay, mixed precision,
gradient accumulation, exact evaluation every few epochs, rank-0 checkpoints and --resume.

    torchrun --standalone --nproc-per-node 2 06_amp_syncbn/cifar_resnet.py --epochs 30
    torchrun --standalone --nproc-per-node 2 06_amp_syncbn/cifar_resnet.py --checkpoint-dir runs/cifar --resume
    make cifar-resnet NPROC=2                    # a short run; EPOCHS=N for a real one

Real CIFAR-10 when it is in --data-dir (`make data`), the offline stand-in otherwise. On a CPU,
ResNet-18 trains at about 50 images/s per process: an epoch of the stand-in takes minutes.
"""

import argparse
import contextlib
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


def train(rank, world_size, args, device):
    common.seed_everything(args.seed)
    train_set = common.load_dataset(args.dataset, args.data_dir, train=True)
    test_set = common.load_dataset(args.dataset, args.data_dir, train=False)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_loader = common.batch_loader(train_set, args.batch_size, sampler=sampler, pin_memory=device.type == "cuda")
    test_loader = common.batch_loader(test_set, 500, sampler=range(rank, len(test_set), world_size))
    augment_rng = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own crops and flips

    model = DDP(common.resnet18_cifar().to(device), device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.amp)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    path = Path(args.checkpoint_dir) / "cifar_resnet.pt" if args.checkpoint_dir else None
    start_epoch = 0
    if args.resume and path and path.exists():
        state = common.load_checkpoint(path)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        start_epoch = state["epoch"]
        common.print0(rank, f"resumed from {path} after epoch {start_epoch}")

    common.print0(rank, f"ResNet-18 on {args.dataset} ({len(train_set)} train / {len(test_set)} test), "
                        f"{world_size} processes, batch {args.batch_size} x {args.accum_steps} accumulation "
                        f"per process, amp {args.amp}")
    start, acc, samples = time.time(), None, 0
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        steps = min(len(train_loader), args.max_steps * args.accum_steps or len(train_loader))
        for step, (images, labels) in enumerate(common.progress(train_loader, rank, f"epoch {epoch + 1}", steps)):
            if step == steps:
                break
            # augment on the device, after the (pinned, non-blocking) copy: no CPU work per batch
            images = common.augment_cifar(images.to(device, non_blocking=True), augment_rng)
            labels = labels.to(device, non_blocking=True)
            last_micro = (step + 1) % args.accum_steps == 0 or step + 1 == steps
            # all-reduce only on the last micro-batch of an optimizer step
            with contextlib.nullcontext() if last_micro else model.no_sync():
                with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                    loss = F.cross_entropy(model(images), labels) / args.accum_steps
                scaler.scale(loss).backward()
            if last_micro:
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)

        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            for buffer in model.module.buffers():  # BatchNorm statistics: rank 0's everywhere (see section 02)
                dist.broadcast(buffer, src=0)
            totals = common.evaluate(model.module, test_loader, device)
            dist.all_reduce(totals)  # every rank evaluated its own part: add them up
            acc, samples = totals[0].item() / totals[1].item(), int(totals[1].item())
            common.print0(rank, f"epoch {epoch + 1}: train_loss={loss.item() * args.accum_steps:.4f} (rank 0) "
                                f"test_acc={acc:.4f}")
        if rank == 0 and path:
            common.atomic_save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                                "scaler": scaler.state_dict(), "epoch": epoch + 1}, path)
    if acc is not None:
        common.print0(rank, common.final_line(test_acc=acc, test_samples=samples, world_size=world_size,
                                              epochs=args.epochs, seconds=time.time() - start, dataset=args.dataset,
                                              amp=args.amp))


@record
def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(parser, family="cifar10", epochs=2, batch_size=32, lr=0.05)
    parser.add_argument("--amp", default="auto", choices=("auto", "off", "fp16", "bf16"),
                        help="auto = fp16 on CUDA, bf16 on CPU")
    parser.add_argument("--accum-steps", type=common.positive_int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--eval-every", type=common.positive_int, default=1,
                        help="evaluate every K epochs (and after the last)")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        parser.error("start me with torchrun, e.g. torchrun --standalone --nproc-per-node 2 " + __file__)
    rank, world_size, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    procs_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    device, backend = common.check_args(parser, args, local_rank=local_rank, procs_per_node=procs_per_node)
    common.print0(rank, common.runtime_report(device, backend, procs_per_node))
    if args.amp == "auto":
        args.amp = "fp16" if device.type == "cuda" else "bf16"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout),
                            device_id=device if backend == "nccl" else None)
    try:
        # one process per node prepares the data (see mnist_torchrun.py); a download may outlast --timeout
        data_ready = dist.new_group(backend="gloo", timeout=timedelta(minutes=30))
        if local_rank == 0:
            args.dataset = common.prepare_data(args.dataset, args.data_dir, family="cifar10")
        dist.barrier(group=data_ready)
        args.dataset = common.resolve_dataset(args.dataset, args.data_dir, family="cifar10")
        train(rank, world_size, args, device)
        dist.barrier()  # every rank finishes its work before any tears the group down
    finally:
        gc.collect()  # free the DDP model while the group still exists
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    common.leave()  # skip the interpreter teardown that can abort (see common.leave)
