"""Watch nn.DataParallel split a batch: the model prints the shape it receives, the loop the shape it gets back.

    python 01_dataparallel/dataparallel_shapes.py              # on all visible GPUs
    python 01_dataparallel/dataparallel_shapes.py --gpus 2     # what 2 GPUs would do, also on a CPU machine
    python 01_dataparallel/dataparallel_shapes.py --gpus 4 --loss-inside   # the loss computed in forward
    make dp-shapes

100 random samples in batches of 30 give batches of 30, 30, 30 and 10. On 2 GPUs each batch is cut
in two along dimension 0 (15 + 15, and 5 + 5 for the last), each half runs on its own GPU in its
own thread, and the halves are glued back together on the output device.

With --loss-inside the model computes its loss in forward, the case the DataParallel and DDP notes' `loss =
loss.mean()` after DataParallel is for (their own loss is computed outside the model): every GPU returns one 0-dim
loss, and DataParallel gathers them into a vector of one loss per GPU (warning that it gathered scalars).
`loss.mean()` makes it one number again, but it weighs every GPU's piece equally: when the pieces differ in size
(30 over 4 GPUs: 8, 8, 8, 6) that is not the loss of the whole batch.
"""

import argparse
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import common


class RandomDataset(Dataset):
    """`length` random vectors of size `features` (the DataParallel shape demo's input)."""

    def __init__(self, length: int, features: int, seed: int = 0):
        self.data = torch.randn(length, features, generator=torch.Generator().manual_seed(seed))

    def __getitem__(self, index):
        return self.data[index]

    def __len__(self):
        return len(self.data)


class LossModel(nn.Module):
    """The same layer, returning its mean squared error against targets: the loss inside forward."""

    def __init__(self, input_size: int, output_size: int):
        super().__init__()
        self.fc = nn.Linear(input_size, output_size)

    def forward(self, x, target):
        return ((self.fc(x) - target) ** 2).mean()


class ShapeModel(nn.Module):
    """One linear layer that reports the size of every input it sees."""

    def __init__(self, input_size: int, output_size: int):
        super().__init__()
        self.fc = nn.Linear(input_size, output_size)

    def forward(self, x):
        out = self.fc(x)
        where = f"cuda:{x.device.index}" if x.is_cuda else "cpu"
        # one write per line: DataParallel runs the replicas in threads, and print() writes the text and the
        # newline separately, so two replicas' lines could interleave
        sys.stdout.write(f"    In Model on {where}: input size {list(x.shape)} output size {list(out.shape)}\n")
        sys.stdout.flush()
        return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=None,
                        help="how many GPUs to split over (default: all visible; on CPU: 2, simulated)")
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=30)
    parser.add_argument("--loss-inside", action="store_true", help="the model returns its loss (see above)")
    args = parser.parse_args()
    visible = common.usable_gpus()  # 0 without CUDA, or with GPUs too old for this torch
    if args.gpus is not None and args.gpus < 1:
        parser.error("--gpus must be at least 1")
    n = args.gpus or max(visible, 2)  # by default all GPUs, and at least the 2 that make a split worth seeing

    loader = DataLoader(RandomDataset(args.samples, 5), batch_size=args.batch_size, shuffle=True)
    if args.loss_inside:
        return loss_inside(loader, n, visible)
    model = ShapeModel(5, 2)
    if n <= visible:
        print(f"Let's use {n} GPU(s): nn.DataParallel(device_ids={list(range(n))})", flush=True)
        model = nn.DataParallel(model.to("cuda:0"), device_ids=list(range(n)))
        for batch in loader:
            out = model(batch.to("cuda:0"))  # DataParallel scatters, runs the replicas in threads, gathers
            print(f"Outside: input size {list(batch.shape)} output size {list(out.shape)}", flush=True)
        return

    why = "no CUDA GPU is visible" if not visible else f"only {visible} GPU(s) are visible"
    print(f"{why}, so nothing can be split here. nn.DataParallel would cut each batch into {n} "
          f"piece(s) along dim 0, like torch.chunk, one per GPU:", flush=True)
    model = model if torch.cuda.is_available() else nn.DataParallel(model)  # without CUDA it calls the model as is
    for batch in loader:
        sizes = [len(piece) for piece in batch.chunk(n)]
        for gpu, size in enumerate(sizes):
            print(f"    would run on cuda:{gpu}: input size [{size}, 5] output size [{size}, 2]", flush=True)
        out = model(batch)
        print(f"Outside: input size {list(batch.shape)} output size {list(out.shape)}", flush=True)


def loss_inside(loader, n, visible):
    """One loss per GPU, gathered into a vector; its mean, against the loss of the whole batch."""
    torch.manual_seed(0)
    model = LossModel(5, 2)
    batch = next(iter(loader))
    target = torch.randn(len(batch), 2)
    whole = model(batch, target).item()
    if n <= visible or (n == 1 and not torch.cuda.is_available()):  # a CPU-only machine: DP calls the model
        where = "cuda:0" if n <= visible else "cpu"
        dp = nn.DataParallel(model.to(where), device_ids=list(range(n)) if n <= visible else None)
        # a vector of one loss per GPU; with one device DataParallel just calls the model: its own 0-dim loss
        gathered = dp(batch.to(where), target.to(where)).cpu()
    else:  # what the n replicas would compute: the same arithmetic, piece by piece
        gathered = torch.stack([model(x, t) for x, t in zip(batch.chunk(n), target.chunk(n), strict=True)])
    losses = gathered.reshape(-1)  # one loss per device, also when there is one
    sizes = [len(piece) for piece in batch.chunk(n)]
    print(f"pieces of {sizes} samples on {n} GPU(s){'' if n <= visible else ' (simulated)'}"
          f"{'; one device: DataParallel returns the loss as the model does, nothing gathered' if n == 1 else ''}",
          flush=True)
    print(f"gathered losses: {[round(v, 4) for v in losses.tolist()]} (shape {list(gathered.shape)})", flush=True)
    print(f"loss.mean() = {losses.mean().item():.4f}; the loss of the whole batch = {whole:.4f}"
          f"{'' if len(set(sizes)) == 1 else '; they differ: the pieces are not all the same size'}", flush=True)


if __name__ == "__main__":
    main()
