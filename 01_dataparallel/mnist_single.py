"""Step 1 of the MNIST chain: one process, one device, no parallelism at all.

The baseline every later step changes a little: the same training, data, checkpoints and printing, so that the
diff of each step shows only its lesson. `rank` and `world_size` are 0 and 1 here: the printing, the test split and
the checkpoint writer already take them into account, as the DDP steps need. Run from the repo root:

    python 01_dataparallel/mnist_single.py                      # CPU, or the first GPU if there is one
    python 01_dataparallel/mnist_single.py --dataset mnist-standin --epochs 1
    python 01_dataparallel/mnist_single.py --checkpoint-dir runs/single --epochs 3   # again: it continues
    make smoke                                                  # one epoch on the offline stand-in

Next step: 02_ddp_spawn/mnist_spawn.py, one process per device with DistributedDataParallel.
A side branch: mnist_dataparallel.py, one process driving several GPUs with nn.DataParallel.
"""

import time
from pathlib import Path

import torch
import torch.nn.functional as F
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

    model = common.ConvNet().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # a checkpoint in --checkpoint-dir is continued; one of another run is refused, in one line
    path = Path(args.checkpoint_dir) / f"{Path(__file__).stem}.pt" if args.checkpoint_dir else None
    run = {"script": Path(__file__).name, "model": "ConvNet", "dataset": args.dataset}
    state, start_epoch = common.resume_state(path, run), 0
    if state:
        model.load_state_dict(state["model"])
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
            labels = labels.to(device, non_blocking=True)
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if args.log_every and (step + 1) % args.log_every == 0:
                common.print0(rank, common.line("step", epoch=epoch + 1, step=step + 1, loss=loss.item()))

        totals = common.evaluate(model, test_loader, device)  # sums over the test set: correct, samples, loss
        correct, samples, loss_sum = totals.tolist()
        common.print0(rank, common.line("epoch", epoch=epoch + 1, epochs=args.epochs, train_loss=loss.item(),
                                        test_loss=loss_sum / samples, test_acc=correct / samples))
        if rank == 0 and path:
            common.save_checkpoint(path, run, model=model.state_dict(), optimizer=optimizer.state_dict(),
                                   epoch=epoch + 1, rng=common.rng_state(), device=device.type)

    if start_epoch >= args.epochs:
        common.print0(rank, f"nothing to do: the checkpoint is already at epoch {start_epoch} of {args.epochs}")
        return
    common.print0(rank, common.final_line(
        test_acc=correct / samples, test_samples=int(samples), world_size=world_size, epochs=args.epochs,
        seconds=time.time() - start, dataset=args.dataset, weights=common.weights_digest(model)))


def main():
    parser = common.training_parser(__doc__, distributed=False)
    args = parser.parse_args()
    device, _ = common.check_args(parser, args)  # every mistake in one line, before anything starts
    common.print0(0, common.runtime_report(device))
    try:
        args.dataset = common.prepare_data(args.dataset, args.data_dir)  # once, before any training starts
        train(args, device)
    except common.UsageError as err:
        parser.error(str(err))


if __name__ == "__main__":
    main()
