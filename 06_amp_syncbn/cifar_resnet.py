"""ResNet-18 on CIFAR-10 with DDP: augmentation, SGD with momentum and weight decay, mixed precision,
gradient accumulation, exact evaluation every few epochs, rank-0 checkpoints that a new run continues.

    torchrun --standalone --nproc-per-node 2 06_amp_syncbn/cifar_resnet.py --epochs 30
    torchrun --standalone --nproc-per-node 2 06_amp_syncbn/cifar_resnet.py --checkpoint-dir runs/cifar --epochs 30
    make cifar-resnet NPROC=2                    # a short run; EPOCHS=N for a real one

Real CIFAR-10 when it is in --data-dir (`make data`), the offline stand-in otherwise. On a CPU,
ResNet-18 trains at about 50 images/s per process: an epoch of the stand-in takes minutes.
"""

import contextlib
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
from tools import course, data


def augment_cifar(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """CIFAR's standard augmentation for a whole batch at once: random 32x32 crop of the image padded
    by 4 pixels, and a horizontal flip half of the time. One indexing operation, no per-image loop."""
    n, c, h, w = x.shape
    padded = F.pad(x, (4, 4, 4, 4))
    top = torch.randint(0, 9, (n,), generator=generator).to(x.device)
    left = torch.randint(0, 9, (n,), generator=generator).to(x.device)
    rows = (top.view(n, 1) + torch.arange(h, device=x.device)).view(n, 1, h, 1)
    cols = (left.view(n, 1) + torch.arange(w, device=x.device)).view(n, 1, 1, w)
    out = padded[torch.arange(n, device=x.device).view(n, 1, 1, 1), torch.arange(c, device=x.device).view(1, c, 1, 1),
                 rows, cols]
    flip = (torch.rand(n, generator=generator) < 0.5).to(x.device).view(n, 1, 1, 1)
    return torch.where(flip, out.flip(3), out)


def train(args, device, rank=0, world_size=1):
    common.seed_everything(args.seed)
    train_set = common.load_dataset(args.dataset, args.data_dir, train=True)
    test_set = common.load_dataset(args.dataset, args.data_dir, train=False)
    # DDP: each rank its own shard of the training set; exact shards of the test set (see section 02)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_loader = course.batch_loader(train_set, args.batch_size, sampler=sampler, pin_memory=device.type == "cuda")
    test_loader = course.batch_loader(test_set, 500, sampler=range(rank, len(test_set), world_size))
    augment_rng = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own crops and flips

    # DDP: rank 0's weights everywhere, gradients averaged in every backward
    model = DDP(common.resnet18_cifar().to(device), device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.amp)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    # a checkpoint in --checkpoint-dir is continued; one of another run is refused, in one line
    path = Path(args.checkpoint_dir) / f"{Path(__file__).stem}.pt" if args.checkpoint_dir else None
    run = {"script": Path(__file__).name, "model": "ResNet-18", "dataset": args.dataset, "amp": args.amp}
    state, start_epoch = course.resume_state(path, run), 0
    if state:
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        start_epoch = state["epoch"]
        course.print0(rank, f"resumed from {path} after epoch {start_epoch}{course.use_lr(optimizer, args.lr)}")

    course.print0(rank, f"ResNet-18 on {args.dataset} ({len(train_set)} train / {len(test_set)} test), "
                        f"{world_size} processes, batch {args.batch_size} x {args.accum_steps} accumulation "
                        f"per process, amp {args.amp}")
    start, acc, samples = time.time(), None, 0
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # DDP: a new order every epoch, the same on every rank
        model.train()
        steps = min(len(train_loader), args.max_steps * args.accum_steps or len(train_loader))
        for step, (images, labels) in enumerate(course.progress(train_loader, rank, f"epoch {epoch + 1}", steps)):
            if step == steps:
                break
            # augment on the device, after the (pinned, non-blocking) copy: no CPU work per batch
            images = augment_cifar(images.to(device, non_blocking=True), augment_rng)
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
            for buffer in model.module.buffers():  # DDP: rank 0's BatchNorm statistics everywhere (section 02)
                dist.broadcast(buffer, src=0)
            totals = common.evaluate(model.module, test_loader, device)
            dist.all_reduce(totals)  # DDP: every rank evaluated its own part: add them up
            acc, samples = totals[0].item() / totals[1].item(), int(totals[1].item())
            course.print0(rank, course.line("epoch", epoch=epoch + 1, epochs=args.epochs,
                                            train_loss=loss.item() * args.accum_steps, test_acc=acc))
        if rank == 0 and path:
            course.save_checkpoint(path, run, model=model.module.state_dict(), optimizer=optimizer.state_dict(),
                                   scaler=scaler.state_dict(), epoch=epoch + 1, device=device.type)
    if acc is not None:
        course.print0(rank, course.final_line(test_acc=acc, test_samples=samples, world_size=world_size,
                                              epochs=args.epochs, seconds=time.time() - start, dataset=args.dataset,
                                              amp=args.amp))


@record
def main():
    parser = course.training_parser(__doc__, amp=True, family="cifar10", epochs=2, batch_size=32, lr=0.05)
    parser.add_argument("--accum-steps", type=course.positive_int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--eval-every", type=course.positive_int, default=1,
                        help="evaluate every K epochs (and after the last)")
    course.accept_local_rank(parser)  # what the deprecated torch.distributed.launch passes
    args = parser.parse_args()
    if "RANK" not in os.environ:
        parser.error(f"start me with torchrun, e.g. torchrun --standalone --nproc-per-node 2 {__file__}")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # without LOCAL_RANK (by hand, or the old launcher): its --local-rank, or on one machine local rank = rank
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank if args.local_rank >= 0 else rank))
    procs_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    device, backend = course.check_args(parser, args, rank=rank, world_size=world_size, local_rank=local_rank,
                                        procs_per_node=procs_per_node)
    course.print0(rank, course.runtime_report(device, backend, procs_per_node))
    if args.amp == "auto":
        args.amp = "fp16" if device.type == "cuda" else "bf16"
    workarounds.stop_with_launcher()  # workaround: a killed launcher takes this worker with it
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout),  # DDP: join the job
                            device_id=device if backend == "nccl" else None)
    try:
        # one process per node prepares the data (as in mnist_torchrun.py) ...
        if local_rank == 0:
            args.dataset = common.prepare_data(args.dataset, args.data_dir, family="cifar10")
        dist.barrier()  # DDP: ... while the others wait, up to --timeout (run `make data` first for a slow download)
        args.dataset = data.resolve_dataset(args.dataset, args.data_dir, family="cifar10")
        train(args, device, rank, world_size)
        dist.barrier()  # DDP: every rank finishes its work before any tears the group down
    except course.UsageError as err:
        parser.error(str(err))
    finally:
        workarounds.free_ddp_models()  # workaround: free DDP objects before the group goes, or exit can abort
        dist.destroy_process_group()  # DDP: leave the group, also after an error


if __name__ == "__main__":
    main()
