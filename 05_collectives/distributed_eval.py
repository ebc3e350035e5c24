"""Evaluate a model on several processes and get exactly the single-process answer: reduce the sums.

The usual shortcut, a DistributedSampler over the test set, pads it so that every rank gets the same
number of samples: some images are counted twice. This script shows the padded count next to the
exact one (rank r takes images r, r+world_size, ...), adds the sums up with dist.reduce onto rank 0,
and compares with a plain single-process evaluation. Any metric built from counts works the same way: each rank
counts its confusion matrix (true class x predicted class), one reduce adds them, and per-class recall or the
mean IoU of a segmentation model comes out of the sum exactly.

    torchrun --standalone --nproc-per-node 3 05_collectives/distributed_eval.py
    torchrun --standalone --nproc-per-node 3 05_collectives/distributed_eval.py \\
        --checkpoint runs/elastic/straight/mnist_torchrun.pt
    make ddp-eval NPROC=3

It runs on the CPU with Gloo on every machine, GPUs or not: the lesson is arithmetic, not devices.
"""

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, RandomSampler, Subset
from torch.utils.data.distributed import DistributedSampler

import common


def quick_model(data_dir, steps=100):
    """A briefly trained ConvNet, for when no --checkpoint is given (rank 0 trains, the others load)."""
    common.seed_everything(0)
    model = common.ConvNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    train = common.load_dataset("mnist-standin", data_dir, train=True)
    loader = DataLoader(train, batch_size=64, sampler=RandomSampler(train, generator=torch.Generator().manual_seed(0)))
    for step, (x, y) in enumerate(loader):
        if step == steps:
            break
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model.state_dict()


@torch.no_grad()
def confusion_matrix(model, loader, classes: int = 10) -> torch.Tensor:
    """matrix[t, p] = how many images of class t the model called p: counts, so the ranks' matrices add up."""
    matrix = torch.zeros(classes, classes, dtype=torch.int64)
    for x, y in loader:
        matrix += torch.bincount(y * classes + model(x).argmax(1), minlength=classes * classes).view(classes, classes)
    return matrix


def mean_iou(matrix: torch.Tensor) -> float:
    """Mean over the classes that occur of TP / (TP + FP + FN), from the summed matrix (not a mean of means)."""
    tp = matrix.diag().double()
    union = matrix.sum(0) + matrix.sum(1) - matrix.diag()
    return (tp[union > 0] / union[union > 0]).mean().item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="a checkpoint from the MNIST chain (default: train 100 steps)")
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--subset", type=int, default=0, help="evaluate only the first N test images")
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    if "RANK" not in os.environ:
        parser.error("start me with torchrun, e.g. torchrun --standalone --nproc-per-node 3 " + __file__)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    try:
        rank, ws = dist.get_rank(), dist.get_world_size()
        path = args.checkpoint or os.path.join(args.data_dir, "standin", "distributed_eval_model.pt")
        if rank == 0:
            common.prepare_data("mnist-standin", args.data_dir)
            if not args.checkpoint:
                torch.save(quick_model(args.data_dir), path + ".tmp")
                os.replace(path + ".tmp", path)  # a run stopped while saving leaves no half-written model
        dist.barrier()  # the data and the model exist before anyone reads them
        state = torch.load(path, map_location="cpu", weights_only=True)
        model = common.ConvNet()
        model.load_state_dict(state.get("model", state))
        model.eval()
        test = common.load_dataset("mnist-standin", args.data_dir, train=False)
        if args.subset:
            test = Subset(test, range(min(args.subset, len(test))))
        n = len(test)

        # the shortcut: DistributedSampler pads to a multiple of the world size
        padded = DistributedSampler(test, num_replicas=ws, rank=rank, shuffle=False)
        naive = common.evaluate(model, DataLoader(test, batch_size=500, sampler=padded), "cpu")
        # exact: disjoint strided shards, nothing repeated, nothing left out
        shard = DataLoader(Subset(test, range(rank, n, ws)), batch_size=500)
        exact = common.evaluate(model, shard, "cpu")
        mine = exact.clone()
        matrix = confusion_matrix(model, shard)

        dist.all_reduce(naive)             # every rank gets the (wrong) padded totals
        dist.reduce(exact, dst=0)          # only rank 0 needs the totals: reduce, not all_reduce
        dist.reduce(matrix, dst=0)         # the same for any metric made of counts
        rows = [None] * ws
        dist.all_gather_object(rows, (mine[1].item(), exact[1].item()))
        if rank == 0:
            whole = DataLoader(test, batch_size=500)
            single = common.evaluate(model, whole, "cpu")
            print(f"{n} test images, {ws} ranks")
            print(f"  padded DistributedSampler: counted {int(naive[1])} images "
                  f"({int(naive[1]) - n} counted twice), accuracy {naive[0] / naive[1]:.4f}")
            print(f"  exact shards + reduce:     counted {int(exact[1])} images, "
                  f"accuracy {exact[0] / exact[1]:.4f}")
            print(f"  single process:            counted {int(single[1])} images, "
                  f"accuracy {single[0] / single[1]:.4f}")
            one = confusion_matrix(model, whole)
            print(f"  confusion matrix summed over the ranks: mean IoU {mean_iou(matrix):.4f} "
                  f"(single process {mean_iou(one):.4f}), matrices equal: {torch.equal(matrix, one)}")
            print("  after dist.reduce(dst=0), what each rank holds as its 'count':")
            total = sum(own for own, _ in rows)
            for r, (own, held) in enumerate(rows):  # what the value is, as seen; only dst's is promised
                seen = "the total" if held == total else "its own shard" if held == own else "neither"
                note = "dst" if r == 0 else "unspecified, read dst only"
                print(f"    rank {r}: own shard {int(own)}, holds {held:g} = {seen} ({note})")
            same = torch.equal(exact[:2], single[:2]) and torch.allclose(exact[2], single[2])
            print(f"result: padded_count={int(naive[1])} exact_count={int(exact[1])} "
                  f"exact_equals_single={same}")
        dist.barrier()  # every rank finishes its work before any tears the group down
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
