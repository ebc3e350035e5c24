"""Compare the model weights of two checkpoints: are two runs' results bitwise identical?

    python 03_ddp_torchrun/compare_checkpoints.py runs/elastic/straight/mnist_torchrun.pt \\
        runs/elastic/recovered/mnist_torchrun.pt

Exit code 0 when every tensor is equal, 1 otherwise (and the largest difference is printed).

On the CPU the course's resume and restart demos give bitwise the same weights. Checkpoints trained on a
GPU are compared within --gpu-atol instead (on a machine with CUDA): cuDNN is made deterministic,
but NCCL's and cuDNN's summation order is not promised to be the same from run to run.
"""

import argparse
import sys

import torch


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("first")
    parser.add_argument("second")
    parser.add_argument("--gpu-atol", type=float, default=1e-5,
                        help="largest difference allowed when a checkpoint was trained on a GPU (default %(default)s)")
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
    if not equal and torch.cuda.is_available():
        equal = worst <= args.gpu_atol
        verdict = f"identical within {args.gpu_atol:g} (trained on a GPU): {equal}"
    else:
        verdict = f"bitwise identical: {equal}"
    print(f"epochs {a.get('epoch')} and {b.get('epoch')}: {len(ma)} tensors, {verdict}, "
          f"largest difference {worst:.3g}", flush=True)
    sys.exit(0 if equal else 1)


if __name__ == "__main__":
    main()
