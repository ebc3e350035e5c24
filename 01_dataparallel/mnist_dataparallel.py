"""A side branch of step 1: the same training, one process driving several GPUs with nn.DataParallel.

Every forward pass copies the model to each GPU, splits the batch along dimension 0, runs the pieces
in threads and gathers the outputs on one GPU. Without a usable GPU the script trains the plain model:
it runs, nothing is split.

    python 01_dataparallel/mnist_dataparallel.py                    # all visible GPUs, or the CPU
    python 01_dataparallel/mnist_dataparallel.py --gpus 0,1 --output-device 1
    make dataparallel

The main line goes on at 02_ddp_spawn/mnist_spawn.py: one process per device, DistributedDataParallel.
"""

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, Subset
from tqdm import tqdm

import common


def train(args, device, rank=0, world_size=1):
    common.seed_everything(args.seed)
    train_set = common.load_dataset(args.dataset, args.data_dir, train=True)
    test_set = common.load_dataset(args.dataset, args.data_dir, train=False)
    shuffle = torch.Generator()
    sampler = RandomSampler(train_set, generator=shuffle)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, pin_memory=device.type == "cuda")
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world_size)), batch_size=1000)

    gpus = args.gpus or list(range(common.usable_gpus()))  # DP: the GPUs to split over, all visible by default
    device = torch.device("cuda", gpus[0]) if gpus else device  # DP: the model must live on the first of them
    net = common.ConvNet().to(device)
    # without a usable GPU there is nothing to split, and the plain model trains
    model = nn.DataParallel(net, device_ids=gpus, output_device=args.output_device) if gpus else net  # DP: wrap
    if gpus:  # with one GPU DataParallel just calls the model there: nothing to split
        print(f"nn.DataParallel over GPUs {gpus}: " + (f"each batch of {args.batch_size} is split {len(gpus)} ways"
                                                       if len(gpus) > 1 else "one GPU, nothing is split"))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    path = os.path.join(args.checkpoint_dir, "mnist_dataparallel.pt") if args.checkpoint_dir else ""
    start_epoch = 0
    if path and os.path.exists(path):  # continue a run
        state = torch.load(path, map_location=device, weights_only=True)
        net.load_state_dict(state["model"])  # net is model.module: keys without the "module." prefix
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"]
        if rank == 0:
            print(f"resumed from {path} after epoch {start_epoch}")

    start = time.time()
    for epoch in range(start_epoch, args.epochs):
        shuffle.manual_seed(args.seed + epoch)  # a new order every epoch, and the same one in a resumed run
        model.train()
        train_sums = torch.zeros(2, dtype=torch.float64, device=device)  # this rank's loss x samples, samples
        bar = tqdm(train_loader, desc=f"epoch {epoch + 1}", disable=None if rank == 0 else True)  # rank 0, a terminal
        for step, (images, labels) in enumerate(bar):
            if args.max_steps and step == args.max_steps:  # --max-steps: a short epoch (smoke runs, CI)
                break
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            out = model(images)  # DP: split, run on every GPU, gathered on --output-device
            loss = F.cross_entropy(out, labels.to(out.device))  # DP: the labels go where the outputs were gathered
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            train_sums[0] += loss.detach().to(device) * len(labels)  # DP: the loss is on --output-device
            train_sums[1] += len(labels)
            if rank == 0 and args.log_every and (step + 1) % args.log_every == 0:
                print(f"step: epoch={epoch + 1} step={step + 1} loss={loss.item():.4f}")

        totals = common.evaluate(model, test_loader, device)  # sums over the test set: correct, samples, loss
        correct, samples, loss_sum = totals.tolist()
        train_loss_sum, trained = train_sums.tolist()  # the epoch's training loss, averaged over its samples
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: train_loss={train_loss_sum / trained:.4f} "
                  f"test_loss={loss_sum / samples:.4f} test_acc={correct / samples:.4f}")
        if rank == 0 and path:
            state = {"model": net.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch + 1}
            os.makedirs(args.checkpoint_dir, exist_ok=True)
            torch.save(state, path + ".tmp")
            os.replace(path + ".tmp", path)  # a crash while saving leaves the last good checkpoint
    if rank == 0 and start_epoch < args.epochs:
        print(f"final: test_acc={correct / samples:.4f} test_samples={int(samples)} world_size={world_size} "
              f"epochs={args.epochs} seconds={time.time() - start:.1f} dataset={args.dataset}")


def main():
    parser = argparse.ArgumentParser(description="MNIST with nn.DataParallel: one process, several GPUs.")
    parser.add_argument("--gpus", type=lambda text: [int(g) for g in text.split(",")],
                        help="device_ids: the GPUs to use, e.g. 0,1 (default: all visible)")
    parser.add_argument("--output-device", type=int, help="the GPU that gathers the outputs (default: the first)")
    args = common.add_training_flags(parser).parse_args()
    device, _ = common.device_and_backend(args.device)
    args.dataset = common.prepare_data(args.dataset, args.data_dir)  # download or write the data, once
    print(f"1 process on {device.type}" + ("" if device.type == "cuda" else
          ": without a usable GPU nothing is split, and the plain model trains"))
    train(args, device)


if __name__ == "__main__":
    main()
