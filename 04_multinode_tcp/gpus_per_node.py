"""Which GPUs each simulated node gets when several "nodes" run on one machine (the local launchers use it).

On real machines every node numbers its own GPUs from 0. Simulated nodes on one machine would all take
GPU 0, 1, ... and NCCL refuses two processes on one GPU. So node i sees only its own slice of the GPUs,
through CUDA_VISIBLE_DEVICES, and inside it the GPUs are numbered from 0 again, as on a real node.
With too few GPUs for one per process, every node runs on the CPU (and a NOTE says so).

    python 04_multinode_tcp/gpus_per_node.py NNODES NPROC

prints one line per node: its CUDA_VISIBLE_DEVICES ("0,1", "2,3", ...), "cpu" (GPUs exist, but too few),
or an empty line (no GPU at all: nothing to choose).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def plan(nnodes: int, nproc: int, visible: list[str]) -> tuple[list[str], str]:
    """(per node: its CUDA_VISIBLE_DEVICES value, "cpu", or "" without GPUs; a NOTE or "").

    `visible` are the GPUs this machine shows (their ids as CUDA_VISIBLE_DEVICES would name them).
    """
    need = nnodes * nproc
    if not visible:
        return [""] * nnodes, ""
    if len(visible) < need:
        return ["cpu"] * nnodes, (f"NOTE: THE NODES RUN ON THE CPU: {nnodes} nodes x {nproc} processes need {need} "
                                  f"GPUs (one each) and {len(visible)} are visible. Use NPROC and NNODES with "
                                  f"NNODES x NPROC <= {len(visible)} to run on the GPUs.")
    return [",".join(visible[i * nproc:(i + 1) * nproc]) for i in range(nnodes)], ""


def visible_gpus() -> list[str]:
    """The GPUs this process may use, named as CUDA_VISIBLE_DEVICES names them (indices or UUIDs)."""
    if not any(Path(p).exists() for p in ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/dxg")):
        return []  # no NVIDIA driver (WSL2 shows /dev/dxg): no GPU, and no need to import torch to learn it
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    named = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in named.split(",") if d.strip()] if named is not None else [str(i) for i in range(count)]
    return ids[:count]


def main(argv: list[str]) -> int:
    if argv in (["-h"], ["--help"]):
        print(__doc__.strip())
        return 0
    try:
        nnodes, nproc = (int(a) for a in argv)
        if nnodes < 1 or nproc < 1:
            raise ValueError
    except ValueError:
        print("usage: gpus_per_node.py NNODES NPROC (whole numbers of at least 1)", file=sys.stderr)
        return 2
    nodes, note = plan(nnodes, nproc, visible_gpus())
    if note:
        print(note, file=sys.stderr)
    print("\n".join(nodes))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
