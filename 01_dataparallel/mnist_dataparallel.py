"""Step 2 of the MNIST chain: the same training, with the model wrapped in nn.DataParallel.

One process drives several GPUs: every forward pass copies the model to each GPU, splits the
batch along dimension 0, runs the pieces in threads and gathers the outputs on one GPU.
Without a GPU, nn.DataParallel simply calls the model: the script runs, nothing is split.

    python 01_dataparallel/mnist_dataparallel.py                    # all visible GPUs, or the CPU
    python 01_dataparallel/mnist_dataparallel.py --gpus 0,1 --output-device 1
    make dataparallel

Next step: 02_ddp_spawn/mnist_spawn.py, one process per device with DistributedDataParallel.
"""

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import common


def train(args, device):
    common.seed_everything(args.seed)
    dataset = common.prepare_data(args.dataset, args.data_dir)
    train_set = common.load_dataset(dataset, args.data_dir, train=True)
    test_set = common.load_dataset(dataset, args.data_dir, train=False)
    train_loader = common.batch_loader(train_set, args.batch_size, shuffle=True, seed=args.seed,
                                       pin_memory=device.type == "cuda")
    test_loader = common.batch_loader(test_set, 1000)

    model = common.ConvNet()
    if device.type == "cuda":
        gpus = args.gpus or list(range(torch.cuda.device_count()))
        output_device = gpus[0] if args.output_device is None else args.output_device
        device = torch.device("cuda", gpus[0])  # the master copy lives on the first listed GPU
        model = nn.DataParallel(model.to(device), device_ids=gpus, output_device=output_device)
        out_device = torch.device("cuda", output_device)
        print(f"nn.DataParallel over GPUs {gpus}: each batch of {args.batch_size} is split "
              f"{len(gpus)} ways; outputs and loss on cuda:{output_device}", flush=True)
    else:
        model = nn.DataParallel(model)
        out_device = device
        print("nn.DataParallel without a GPU: it calls the model directly, in this one process "
              "(nothing is split or copied)", flush=True)
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
            labels = labels.to(out_device, non_blocking=True)  # outputs are gathered on output_device
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if args.log_every and (step + 1) % args.log_every == 0:
                print(f"epoch {epoch + 1} step {step + 1}/{steps} loss={loss.item():.4f}", flush=True)

        correct, samples, loss_sum = common.evaluate(model, test_loader, out_device).tolist()
        print(f"epoch {epoch + 1}/{args.epochs}: train_loss={loss.item():.4f} "
              f"test_loss={loss_sum / samples:.4f} test_acc={correct / samples:.4f}", flush=True)
        if args.checkpoint_dir:
            path = Path(args.checkpoint_dir) / "mnist_dataparallel.pt"
            # .module is the plain ConvNet: its keys have no "module." prefix, so anyone can load them
            common.atomic_save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                                "epoch": epoch + 1}, path)

    print(common.final_line(test_acc=correct / samples, test_samples=int(samples), world_size=1,
                            epochs=args.epochs, seconds=time.time() - start, dataset=dataset,
                            replicas=max(1, len(model.device_ids))), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(parser, distributed=False)
    parser.add_argument("--gpus", type=lambda s: [int(i) for i in s.split(",")], default=None,
                        help="device_ids: the GPUs to use, e.g. 0,1 (default: all visible)")
    parser.add_argument("--output-device", type=int, default=None,
                        help="the GPU that gathers the outputs and computes the loss (default: the first of --gpus)")
    args = parser.parse_args()
    device, _ = common.check_args(parser, args)
    gpus = common.gpu_count()
    if (args.gpus or args.output_device is not None) and device.type != "cuda":
        parser.error("--gpus and --output-device need CUDA GPUs; on the CPU, DataParallel has nothing to split")
    if args.device == "cpu" and gpus:
        parser.error("--device cpu: DataParallel only splits work over GPUs; for the CPU use mnist_single.py")
    for gpu in (args.gpus or []) + ([args.output_device] if args.output_device is not None else []):
        if not 0 <= gpu < gpus:
            parser.error(f"GPU {gpu} does not exist: this machine has {gpus} (ids 0..{gpus - 1})")
    if args.output_device is not None and len(args.gpus or range(gpus)) == 1 and \
            args.output_device != (args.gpus or [0])[0]:
        parser.error("with one GPU, DataParallel just calls the model (nothing to gather): --output-device "
                     "must be that GPU")
    print(common.runtime_report(device), flush=True)
    try:
        train(args, device)
    except common.UsageError as err:
        parser.exit(2, f"error: {err}\n")


if __name__ == "__main__":
    main()
