"""A side branch of step 1: the same training, one process driving several GPUs with nn.DataParallel.

Every forward pass copies the model to each GPU, splits the batch along dimension 0, runs the pieces
in threads and gathers the outputs on one GPU. Without a GPU, nn.DataParallel simply calls the model:
the script runs, nothing is split.

    python 01_dataparallel/mnist_dataparallel.py                    # all visible GPUs, or the CPU
    python 01_dataparallel/mnist_dataparallel.py --gpus 0,1 --output-device 1
    make dataparallel

The main line goes on at 02_ddp_spawn/mnist_spawn.py: one process per device, DistributedDataParallel.
"""

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import RandomSampler

import common


def train(args, device, rank=0, world_size=1):
    common.seed_everything(args.seed)
    train_set = common.load_dataset(args.dataset, args.data_dir, train=True)
    test_set = common.load_dataset(args.dataset, args.data_dir, train=False)
    shuffle = torch.Generator()
    sampler = RandomSampler(train_set, generator=shuffle)
    train_loader = common.batch_loader(train_set, args.batch_size, sampler=sampler, pin_memory=device.type == "cuda")
    test_loader = common.batch_loader(test_set, 1000, sampler=range(rank, len(test_set), world_size))

    gpus = args.gpus or list(range(common.gpu_count()))  # DP: the GPUs to split over, all visible by default
    device = torch.device("cuda", gpus[0]) if gpus else device  # DP: the model must live on the first of them
    model = common.ConvNet().to(device)
    model = nn.DataParallel(model, device_ids=gpus or None, output_device=args.output_device)  # DP: one process
    out_device = torch.device("cuda", model.output_device) if gpus else device  # DP: outputs gathered here
    common.print0(rank, f"nn.DataParallel over GPUs {gpus}: a batch of {args.batch_size} is split {len(gpus)} "
                        f"ways; outputs and loss on {out_device}" if gpus else
                        "nn.DataParallel without a GPU: it calls the model directly (nothing is split or copied)")
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # a checkpoint in --checkpoint-dir is continued; one of another run is refused, in one line
    path = Path(args.checkpoint_dir) / f"{Path(__file__).stem}.pt" if args.checkpoint_dir else None
    run = {"script": Path(__file__).name, "model": "ConvNet", "dataset": args.dataset}
    state, start_epoch = common.resume_state(path, run), 0
    if state:
        model.module.load_state_dict(state["model"])  # DP: the inner model, keys without "module."
        optimizer.load_state_dict(state["optimizer"])
        common.set_rng_state(state["rng"])
        start_epoch = state["epoch"]
        common.print0(rank, f"resumed from {path} after epoch {start_epoch}{common.use_lr(optimizer, args.lr)}")

    common.print0(rank, f"training ConvNet on {args.dataset} ({len(train_set)} train / {len(test_set)} test "
                        f"images) with {world_size} process(es) on {device.type}, batch {args.batch_size} per "
                        f"process, {args.epochs} epoch(s)")
    start = time.time()
    for epoch in range(start_epoch, args.epochs):
        shuffle.manual_seed(args.seed + epoch)  # a new order every epoch, and the same one in a resumed run
        if args.show_shards:
            common.say(common.shard_line(rank, epoch, sampler))
        model.train()
        steps = min(len(train_loader), args.max_steps or len(train_loader))
        bar = common.progress(train_loader, rank, desc=f"epoch {epoch + 1}/{args.epochs}", total=steps)
        for step, (images, labels) in enumerate(bar):
            if step == steps:
                break
            images = images.to(device, non_blocking=True)
            labels = labels.to(out_device, non_blocking=True)  # DP: the loss is computed where outputs are
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if args.log_every and (step + 1) % args.log_every == 0:
                common.print0(rank, common.line("step", epoch=epoch + 1, step=step + 1, loss=loss.item()))

        totals = common.evaluate(model, test_loader, out_device)  # sums over the test set: correct, samples, loss
        correct, samples, loss_sum = totals.tolist()
        common.print0(rank, common.line("epoch", epoch=epoch + 1, epochs=args.epochs, train_loss=loss.item(),
                                        test_loss=loss_sum / samples, test_acc=correct / samples))
        if rank == 0 and path:
            common.save_checkpoint(path, run, model=model.module.state_dict(),  # DP: plain keys for anyone
                                   optimizer=optimizer.state_dict(),
                                   epoch=epoch + 1, rng=common.rng_state(), device=device.type)

    if start_epoch >= args.epochs:
        common.print0(rank, f"nothing to do: the checkpoint is already at epoch {start_epoch} of {args.epochs}")
        return
    common.print0(rank, common.final_line(
        test_acc=correct / samples, test_samples=int(samples), world_size=world_size, epochs=args.epochs,
        seconds=time.time() - start, dataset=args.dataset, weights=common.weights_digest(model.module),
        replicas=max(1, len(model.device_ids))))


def gpu_list(text: str) -> list[int]:
    try:
        return [int(i) for i in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GPU numbers such as 0,1; got {text!r}") from None


def check_gpus(parser, args, device):
    """Refuse, in one line, GPU choices that cannot work here."""
    gpus = common.gpu_count()
    if (args.gpus or args.output_device is not None) and device.type != "cuda":
        parser.error("--gpus and --output-device need CUDA GPUs; on the CPU, DataParallel has nothing to split")
    if args.device == "cpu" and gpus:
        parser.error("--device cpu: DataParallel only splits work over GPUs; for the CPU use mnist_single.py")
    for gpu in (args.gpus or []) + ([args.output_device] if args.output_device is not None else []):
        if not 0 <= gpu < gpus:
            parser.error(f"GPU {gpu} does not exist: this machine has {gpus} (ids 0..{gpus - 1})")
    chosen = args.gpus or list(range(gpus))
    if args.output_device is not None and len(chosen) == 1 and args.output_device != chosen[0]:
        parser.error("with one GPU, DataParallel just calls the model (nothing to gather): --output-device "
                     "must be that GPU")


def main():
    parser = common.training_parser(__doc__, distributed=False)
    parser.add_argument("--gpus", type=gpu_list, help="device_ids: the GPUs to use, e.g. 0,1 (default: all visible)")
    parser.add_argument("--output-device", type=int,
                        help="the GPU that gathers the outputs and computes the loss (default: the first of --gpus)")
    args = parser.parse_args()
    device, _ = common.check_args(parser, args)  # every mistake in one line, before anything starts
    check_gpus(parser, args, device)
    common.print0(0, common.runtime_report(device))
    try:
        args.dataset = common.prepare_data(args.dataset, args.data_dir)  # once, before any training starts
        train(args, device)
    except common.UsageError as err:
        parser.error(str(err))


if __name__ == "__main__":
    main()
