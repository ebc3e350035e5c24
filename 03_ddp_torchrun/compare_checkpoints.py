"""Compare the model weights of two checkpoints: are two runs' results bitwise identical?

    python 03_ddp_torchrun/compare_checkpoints.py runs/elastic/straight/mnist_torchrun.pt \\
        runs/elastic/recovered/mnist_torchrun.pt

Exit code 0 when every tensor is equal, 1 otherwise (and the largest difference is printed).
"""

import argparse
import sys

import torch


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("first")
    parser.add_argument("second")
    args = parser.parse_args()
    try:
        a, b = (torch.load(p, map_location="cpu", weights_only=True) for p in (args.first, args.second))
    except (OSError, RuntimeError) as err:
        parser.exit(2, f"error: {err}\n")
    ma, mb = a.get("model", a), b.get("model", b)
    if ma.keys() != mb.keys():
        sys.exit(f"different tensors: {sorted(ma.keys() ^ mb.keys())}")
    worst = max((ma[k].double() - mb[k].double()).abs().max().item() for k in ma)
    equal = all(torch.equal(ma[k], mb[k]) for k in ma)
    print(f"epochs {a.get('epoch')} and {b.get('epoch')}: {len(ma)} tensors, "
          f"bitwise identical: {equal}, largest difference {worst:.3g}", flush=True)
    sys.exit(0 if equal else 1)


if __name__ == "__main__":
    main()
