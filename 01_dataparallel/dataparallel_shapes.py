"""Watch nn.DataParallel split a batch: the model prints the shape it receives, the loop the shape it gets back.

    python 01_dataparallel/dataparallel_shapes.py              # on all visible GPUs
    python 01_dataparallel/dataparallel_shapes.py --gpus 2     # what 2 GPUs would do, also on a CPU machine
    make dp-shapes

100 random samples in batches of 30 give batches of 30, 30, 30 and 10. On 2 GPUs each batch is cut
in two along dimension 0 (15 + 15, and 5 + 5 for the last), each half runs on its own GPU in its
own thread, and the halves are glued back together on the output device.
"""

import argparse

from torch import nn
from torch.utils.data import DataLoader

import common


class ShapeModel(nn.Module):
    """One linear layer that reports the size of every input it sees."""

    def __init__(self, input_size: int, output_size: int):
        super().__init__()
        self.fc = nn.Linear(input_size, output_size)

    def forward(self, x):
        out = self.fc(x)
        where = f"cuda:{x.device.index}" if x.is_cuda else "cpu"
        # one write per line: DataParallel runs the replicas in threads, and print() could interleave them
        common.say(f"    In Model on {where}: input size {list(x.shape)} output size {list(out.shape)}")
        return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=None,
                        help="how many GPUs to split over (default: all visible; on CPU: 2, simulated)")
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=30)
    args = parser.parse_args()
    visible = common.gpu_count()
    if args.gpus is not None and args.gpus < 1:
        parser.error("--gpus must be at least 1")
    n = args.gpus or max(visible, 2)  # by default all GPUs, and at least the 2 that make a split worth seeing

    loader = DataLoader(common.RandomDataset(args.samples, 5), batch_size=args.batch_size, shuffle=True)
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
    model = nn.DataParallel(model) if not visible else model  # without CUDA: calls the model as is
    for batch in loader:
        sizes = [len(piece) for piece in batch.chunk(n)]
        for gpu, size in enumerate(sizes):
            print(f"    would run on cuda:{gpu}: input size [{size}, 5] output size [{size}, 2]", flush=True)
        out = model(batch)
        print(f"Outside: input size {list(batch.shape)} output size {list(out.shape)}", flush=True)


if __name__ == "__main__":
    main()
