"""Step 1 of the MNIST chain: one process, one device, no parallelism at all.

This is the baseline that every later step changes a little. Run from the repo root:

    python 01_dataparallel/mnist_single.py                     # CPU, or the first GPU if there is one
    python 01_dataparallel/mnist_single.py --dataset mnist-standin --epochs 1
    make smoke                                                 # the same, on the offline stand-in

Next step: mnist_dataparallel.py wraps the model in nn.DataParallel.
"""

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import common


def train(args, device):
    common.seed_everything(args.seed)
    dataset = common.prepare_data(args.dataset, args.data_dir)
    train_set = common.load_dataset(dataset, args.data_dir, train=True)
    test_set = common.load_dataset(dataset, args.data_dir, train=False)
    train_loader = common.batch_loader(train_set, args.batch_size, shuffle=True, seed=args.seed,
                                       pin_memory=device.type == "cuda")
    test_loader = common.batch_loader(test_set, 1000)

    model = common.ConvNet().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    print(f"training ConvNet on {dataset} ({len(train_set)} train / {len(test_set)} test images) "
          f"on {device}, batch {args.batch_size}, {args.epochs} epoch(s)", flush=True)
    start = time.time()
    for epoch in range(args.epochs):
        model.train()
        steps = min(len(train_loader), args.max_steps or len(train_loader))
        bar = common.progress(train_loader, rank=0, desc=f"epoch {epoch + 1}/{args.epochs}", total=steps)
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
                print(f"epoch {epoch + 1} step {step + 1}/{steps} loss={loss.item():.4f}", flush=True)

        correct, samples, loss_sum = common.evaluate(model, test_loader, device).tolist()
        print(f"epoch {epoch + 1}/{args.epochs}: train_loss={loss.item():.4f} "
              f"test_loss={loss_sum / samples:.4f} test_acc={correct / samples:.4f}", flush=True)
        if args.checkpoint_dir:
            path = Path(args.checkpoint_dir) / "mnist_single.pt"
            common.atomic_save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                "epoch": epoch + 1}, path)

    print(common.final_line(test_acc=correct / samples, test_samples=int(samples), world_size=1,
                            epochs=args.epochs, seconds=time.time() - start, dataset=dataset), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(parser, distributed=False)
    args = parser.parse_args()
    device, _ = common.check_args(parser, args)
    print(common.runtime_report(device), flush=True)
    try:
        train(args, device)
    except common.UsageError as err:
        parser.exit(2, f"error: {err}\n")


if __name__ == "__main__":
    main()
