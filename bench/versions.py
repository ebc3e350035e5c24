"""Is this version of the course slower on a CPU than an older one? The headline runs of both, side by side.

    python bench/versions.py --old 7cfce49              # make bench-versions OLD=7cfce49
    python bench/versions.py --old HEAD~3 --rounds 3

The older version is taken from git (`git archive`) into a temporary folder; the newer one is this working tree.
Each round runs, from both trees in alternating order, one epoch of the MNIST stand-in with mnist_single.py (one
process), mnist_spawn.py (2 processes) and mnist_torchrun.py (torchrun, 2 processes), each tree with its own
common.py (PYTHONPATH) and its own data folder (prepared by an untimed first run). Two times per run: `seconds` from
the script's final line (training and evaluation) and the wall time of the command (with start-up and shutdown).
The ratios new / old are taken inside each round; 1.10 would mean 10 % slower.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

import torch

import benchlib
from tools import course

REPO = Path(__file__).resolve().parents[1]
DATA = ["--dataset", "mnist-standin", "--epochs", "1", "--device", "cpu"]
RUNS = {  # name: the command, relative to a tree of the course
    "single": ["01_dataparallel/mnist_single.py", *DATA],
    "spawn_ws2": ["02_ddp_spawn/mnist_spawn.py", "--nproc", "2", *DATA],
    "torchrun_ws2": ["-m", "torch.distributed.run", "--standalone", "--local-addr", "127.0.0.1",
                     "--nproc-per-node", "2", "03_ddp_torchrun/mnist_torchrun.py", *DATA],
}


def extract(rev: str, into: Path) -> str:
    """The tree of `rev` in `into`; returns its short commit id. One line on stderr and exit 2 if git refuses."""
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", f"{rev}^{{commit}}"],
                                capture_output=True, text=True, check=True, timeout=60).stdout.strip()
        archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], capture_output=True, check=True,
                                 timeout=120).stdout
    except (subprocess.CalledProcessError, FileNotFoundError):
        print(f"error: --old {rev}: not a commit of this repository", file=sys.stderr)
        sys.exit(2)
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return commit


def timed(tree: Path, name: str, data_dir: Path, timeout: float) -> dict:
    """One run of RUNS[name] in `tree`: its final line's seconds and the wall time."""
    cmd = [sys.executable, *RUNS[name], "--data-dir", str(data_dir)]
    env = {"PYTHONPATH": str(tree), "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"}  # the tree's own common.py
    start = time.perf_counter()
    out = benchlib.run_bounded(cmd, timeout, env=env, cwd=tree).stdout
    wall = time.perf_counter() - start
    final = re.findall(r"^final: .*\bseconds=([0-9.]+)", out, re.M)
    if not final:
        raise RuntimeError(f"{name} in {tree}: no final line\n{out[-2000:]}")
    return {"seconds": float(final[-1]), "wall_s": wall}


def main(argv=None) -> int:
    parser = benchlib.make_parser(__doc__, "1 round")
    parser.add_argument("--old", required=True, help="the older version: a commit, tag or branch (e.g. 7cfce49)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds any one run may take")
    args = parser.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    with tempfile.TemporaryDirectory(prefix="versions-") as tmp:
        old_tree = Path(tmp) / "old"
        old = extract(args.old, old_tree)
        new = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=60).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=60).stdout.strip())
        trees = {"old": (old_tree, Path(tmp) / "data-old"), "new": (REPO, Path(tmp) / "data-new")}
        course.say(f"old: {old} ({args.old}), new: {new}{' with uncommitted changes' if dirty else ''}; "
                   f"{rounds} round(s) of {', '.join(RUNS)}")
        for tree, data in trees.values():  # untimed: each tree writes its own stand-in data
            timed(tree, "single", data, args.timeout)
        per_round = []
        for r in range(rounds):
            result = {}
            for name in RUNS:
                for version in benchlib.rotated(["old", "new"], r + list(RUNS).index(name)):
                    tree, data = trees[version]
                    result[f"{version}/{name}"] = timed(tree, name, data, args.timeout)
            per_round.append(result)
            course.say(f"round {r + 1}/{rounds}: " + ", ".join(
                f"{name} new/old {result[f'new/{name}']['seconds'] / result[f'old/{name}']['seconds']:.2f}"
                for name in RUNS))
    results = {key: {t: benchlib.summarize([r[key][t] for r in per_round]) for t in ("seconds", "wall_s")}
               for key in per_round[0]}
    ratios = {f"{name}/{t}": benchlib.summarize([r[f"new/{name}"][t] / r[f"old/{name}"][t] for r in per_round])
              for name in RUNS for t in ("seconds", "wall_s")}
    machine = benchlib.machine_info(torch.device("cpu"), "gloo")
    name = benchlib.stem(f"versions_{old}", torch.device("cpu"), "gloo", args.quick)
    payload = {"bench": "versions", "machine": machine, "quick": args.quick, "config": {
        "old": old, "old_given_as": args.old, "new": new, "new_uncommitted_changes": dirty, "rounds": rounds,
        "runs": {k: " ".join(v) for k, v in RUNS.items()}}, "per_round": per_round, "results": results,
        "ratios": ratios}
    md = [f"# This version ({new}{'+' if dirty else ''}) vs {old}: one epoch of the MNIST stand-in on the CPU", "",
          f"{machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}. {rounds} rounds, both versions "
          "in alternating order; median (min .. max) over rounds; ratio new / old taken inside each round "
          "(above 1: the new version is slower).", ""]
    rows = [[n, t, f"{results[f'old/{n}'][t]['median']:.2f}", f"{results[f'new/{n}'][t]['median']:.2f}",
             benchlib.fmt_range(ratios[f"{n}/{t}"], digits=3)] for n in RUNS for t in ("seconds", "wall_s")]
    md += benchlib.md_table(["run", "time", f"old {old} (s)", f"new {new} (s)", "new / old"], rows)
    md += ["", "`seconds`: the script's own final line (training and evaluation); `wall_s`: the whole command, "
               "start-up and shutdown included."]
    for path in benchlib.write_results(args.output_dir, name, payload, md):
        course.say(f"written: {path}")
    course.say("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
