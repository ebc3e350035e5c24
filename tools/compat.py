"""Run the course on another torch: a side environment from the package index, a named set of targets, a record.

    python tools/compat.py --torch 2.11.0              # builds .venv-torch2.11.0 (about a minute), runs the set
    python tools/compat.py --python /opt/torch/bin/python   # an interpreter that already holds torch
    python tools/compat.py --torch 2.11.0 --record     # the record goes to bench/results instead of runs/compat
    make compat TORCH=2.11.0 [RECORD=1]

The side environment holds torch, its matching torchvision, tqdm and pytest, and no install of the course, as a
cluster's or a GPU host's Python would; every step runs with it through make (`make TARGET PY=...`), with no
PYTHONPATH from outside. The steps are the targets a learner starts first, the error gallery, the CIFAR-10
example, the doctor on the headline, and the quick tests (`make test-fast`, less the two tests that read these
records). The record,
compat_torch-VERSION_DATE.{json,md}, says for each step whether it passed, how long it took and its `final:` line;
tools/check_torch.py's oldest accepted torch is the oldest version with a record in which every step passed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STANDIN = "DATASET=mnist-standin"
STEPS = [  # (name, make arguments, seconds allowed)
    ("smoke", ["smoke", STANDIN, "ARGS=--max-steps 100"], 300),
    ("ddp-torchrun", ["ddp-torchrun", "NPROC=2", STANDIN, "ARGS=--max-steps 40"], 300),
    ("ddp-spawn", ["ddp-spawn", "NPROC=2", STANDIN, "EPOCHS=1", "ARGS=--max-steps 20"], 300),
    ("collectives", ["collectives", "NPROC=2"], 300),
    ("errors", ["errors"], 600),
    ("amp-syncbn", ["amp-syncbn", "NPROC=2", STANDIN, "ARGS=--max-steps 20"], 300),
    ("cifar-resnet", ["cifar-resnet", "NPROC=2"], 600),
    ("doctor", ["doctor", "SCRIPT=03_ddp_torchrun/mnist_torchrun.py", "ARGS=--dataset mnist-standin"], 300),
]
# the quick tests, less the two that read the compat records themselves (a record cannot wait for its own result)
RECORD_READERS = ("tests/test_foundation.py::test_the_torch_range_is_the_range_that_ran",
                  "tests/test_claims.py::test_every_claim_has_a_proof_that_exists_and_numbers_that_match")
TESTS = ("quick tests", ["test-fast", "ARGS=" + " ".join(f"--deselect {t}" for t in RECORD_READERS)], 900)


def torchvision_for(torch_version: str) -> str:
    """The torchvision release made with a torch release: 2.N goes with 0.(N + 15) (2.11 -> 0.26, 2.14 -> 0.29)."""
    found = re.fullmatch(r"2\.(\d+)\.(\d+)", torch_version)
    if not found:
        raise SystemExit(f"error: --torch wants a release like 2.11.0, got {torch_version!r}")
    return f"0.{int(found.group(1)) + 15}.*"


def side_environment(torch_version: str) -> Path:
    """REPO/.venv-torchVERSION with that torch, its torchvision, tqdm and pytest (made once; a stamp says it is)."""
    venv = REPO / f".venv-torch{torch_version}"
    python = venv / "bin" / "python"
    stamp = venv / ".installed"
    if not stamp.exists():
        print(f"installing torch=={torch_version} and torchvision=={torchvision_for(torch_version)} into {venv} "
              "(about a minute) ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                        f"torch=={torch_version}", f"torchvision=={torchvision_for(torch_version)}", "tqdm", "pytest"],
                       check=True, timeout=1800)
        stamp.touch()
    return python


def disk_gb(folder: Path, pattern: str = "**/*") -> float:
    """The bytes of the files under `folder` matching `pattern`, in GB (10^9), as `du -sb` counts them."""
    return round(sum(p.stat().st_size for p in folder.glob(pattern) if p.is_file() and not p.is_symlink()) / 1e9, 1)


def run_step(name: str, cmd: list[str], timeout: float, env: dict) -> dict:
    """One step in its own session, bounded: on a timeout its whole session is stopped."""
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, code = proc.communicate()[0] + f"\n(stopped after {timeout:.0f} s)", None
    finals = [ln for ln in out.splitlines() if ln.startswith("final: ")]
    summary = [ln for ln in out.splitlines() if re.search(r"\d+ (passed|failed).* in [\d.]+s", ln)]
    counted = re.findall(r"(\d+) (passed|failed|skipped|deselected)", summary[-1] if summary else "")
    return {"step": name, "command": " ".join(cmd), "passed": code == 0, "exit": code,
            "seconds": round(time.time() - start, 1), "final": finals[-1][len("final: "):] if finals else "",
            "counts": {what: int(n) for n, what in counted}, "tail": "" if code == 0 else out[-3000:],
            "verdicts": [ln for ln in out.splitlines() if ln.startswith(("--- ", "result: ", "verdict: "))]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[2:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--torch", help="a torch release from the package index, e.g. 2.11.0")
    which.add_argument("--python", help="an interpreter that already holds torch, torchvision, tqdm and pytest")
    parser.add_argument("--record", action="store_true", help="write the record into bench/results")
    parser.add_argument("--only", default="", help="comma-separated step names (default: all, and the tests)")
    args = parser.parse_args(argv)
    python = str(side_environment(args.torch)) if args.torch else args.python
    probe = subprocess.run([python, "-c", "import sys, torch, torchvision; print(torch.__version__, "
                            "torchvision.__version__, torch.version.cuda, sys.version.split()[0], "
                            "torch.cuda.device_count())"],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        parser.exit(2, f"error: {python} cannot import torch and torchvision: {probe.stderr.strip()[-300:]}\n")
    torch_v, vision_v, cuda, py_v, gpus = probe.stdout.split()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # only what make gives its processes
    env.update(TQDM_DISABLE="1", PYTHONUNBUFFERED="1")
    steps = [(n, ["make", "--no-print-directory", *a, f"PY={python}"], t) for n, a, t in [*STEPS, TESTS]]
    if args.only:
        steps = [s for s in steps if s[0] in args.only.split(",")]
    rows = []
    for i, (name, cmd, timeout) in enumerate(steps, 1):
        row = run_step(name, cmd, timeout, env)
        rows.append(row)
        print(f"[{i}/{len(steps)}] {name}: {'passed' if row['passed'] else 'FAILED'} in {row['seconds']:.0f} s"
              + (f"  final: {row['final']}" if row["final"] else "")
              + (f"  {row['counts']}" if row["counts"] else ""), flush=True)
        if not row["passed"]:
            print(row["tail"][-1500:], flush=True)
    date = time.strftime("%Y-%m-%d")
    version = torch_v.split("+")[0]
    record = {"bench": "compat", "torch": torch_v, "torchvision": vision_v, "cuda": cuda if cuda != "None" else None,
              "python": py_v, "interpreter": os.path.relpath(python, REPO) if args.torch else "given with --python",
              "date": date, "machine": {"arch": platform.machine(), "cores": os.cpu_count(), "gpus": int(gpus)},
              "all_passed": all(r["passed"] for r in rows), "steps": rows}
    if args.torch:  # what such an environment takes on disk, and how much of it is NVIDIA's CUDA libraries
        venv = Path(python).parent.parent
        record["venv_gb"] = disk_gb(venv)
        record["cuda_libraries_gb"] = disk_gb(venv, "lib/python*/site-packages/nvidia*/**/*")
    out_dir = REPO / ("bench/results" if args.record else "runs/compat")
    out_dir.mkdir(parents=True, exist_ok=True)
    name = out_dir / f"compat_torch-{version}_{date}"
    md = [f"# The course on torch {torch_v} (torchvision {vision_v}, Python {py_v}), {date}", "",
          "| step | result | seconds | final line or counts |", "|---|---|---|---|"]
    md += [f"| {r['step']} | {'passed' if r['passed'] else 'FAILED'} | {r['seconds']:.0f} | "
           f"{r['final'] or ', '.join(f'{n} {w}' for w, n in r['counts'].items())} |" for r in rows]
    for path, text in ((Path(f"{name}.json"), json.dumps(record, indent=1) + "\n"),
                       (Path(f"{name}.md"), "\n".join(md) + "\n")):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    failed = [r["step"] for r in rows if not r["passed"]]
    print(f"torch {torch_v}: {len(rows) - len(failed)} of {len(rows)} steps passed"
          + (f"; FAILED: {', '.join(failed)}" if failed else "") + f". Written: {name}.json, {name}.md")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
