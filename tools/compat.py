"""Run the whole test suite on another torch: a side environment from the package index, the suite, a record.

    python tools/compat.py --torch 2.11.0                      # builds .venv-torch2.11.0 (about a minute), runs it
    python tools/compat.py --torch 2.11.0 --with matplotlib    # ... beside matplotlib (.venv-torch2.11.0-matplotlib)
    python tools/compat.py --python /opt/torch/bin/python      # an interpreter that already holds torch
    python tools/compat.py --torch 2.11.0 --record             # the record goes to bench/results, not runs/compat
    make compat TORCH=2.11.0 [WITH=matplotlib] [RECORD=1]

The side environment holds torch, its matching torchvision, tqdm, pytest, pytest-xdist and pytest-timeout (and what
--with adds), and no install of the course, as a cluster's or a GPU host's Python would. The suite runs as
`make test PY=...` runs it (pytest -n 2 over tests/; lint and the notebooks are skipped where ruff and nbval are
missing), less the one test that reads these records. The record, compat_torch-VERSION[-EXTRAS]_DATE.{json,md},
says how many tests passed, failed and were skipped, which failed, how long the suite took, and what this torch does
where releases differ (the tests' own probes: Gloo's list all_to_all, two forwards with synced buffers);
tools/check_torch.py's oldest accepted torch is the oldest version with a record whose suite passed.
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
SUITE_S = 1800  # the suite takes about 11 minutes on 2 cores; a run past half an hour is stopped
TOOLS = ("tqdm", "pytest", "pytest-xdist", "pytest-timeout")  # what a GPU host's Python holds beside torch


def torchvision_for(torch_version: str) -> str:
    """The torchvision release made with a torch release: 2.N goes with 0.(N + 15) (2.11 -> 0.26, 2.14 -> 0.29)."""
    found = re.fullmatch(r"2\.(\d+)\.(\d+)(\+\w+)?", torch_version)
    if not found:
        raise SystemExit(f"error: --torch wants a release like 2.11.0, got {torch_version!r}")
    return f"0.{int(found.group(1)) + 15}.*"


def side_environment(torch_version: str, extras: list[str]) -> Path:
    """REPO/.venv-torchVERSION[-EXTRAS] with that torch, its torchvision, TOOLS and the extras (made once; a stamp
    says it is)."""
    venv = REPO / f".venv-torch{torch_version}{''.join('-' + e for e in extras)}"
    python = venv / "bin" / "python"
    stamp = venv / ".installed"
    if not stamp.exists():
        print(f"installing torch=={torch_version} and torchvision=={torchvision_for(torch_version)} into {venv} "
              "(about a minute) ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                        f"torch=={torch_version}", f"torchvision=={torchvision_for(torch_version)}", *TOOLS, *extras],
                       check=True, timeout=1800)
        stamp.touch()
    return python


def disk_gb(folder: Path, pattern: str = "**/*") -> float:
    """The bytes of the files under `folder` matching `pattern`, in GB (10^9), as `du -sb` counts them."""
    return round(sum(p.stat().st_size for p in folder.glob(pattern) if p.is_file() and not p.is_symlink()) / 1e9, 1)


# the one test that reads these records: a record cannot wait for its own result
RECORD_READER = "tests/test_foundation.py::test_the_torch_range_is_the_range_that_ran"


def run_suite(python: str, env: dict) -> dict:
    """The suite as `make test PY=python` runs it (pytest -n 2 over tests/, the course's folder on PYTHONPATH; lint
    and the notebooks left out, as make test leaves them out where ruff and nbval are missing), but for the test that
    reads these records; in its own session, bounded: on a timeout its whole session is stopped."""
    cmd = [python, "-m", "pytest", "-n", "2", "tests", "--deselect", RECORD_READER, "-p", "no:cacheprovider"]
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, env={**env, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=SUITE_S)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, code = proc.communicate()[0] + f"\n(stopped after {SUITE_S} s)", None
    summary = [ln for ln in out.splitlines() if re.search(r"\d+ (passed|failed).* in [\d.]+s", ln)]
    counted = re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?)", summary[-1] if summary else "")
    counts = {what.rstrip("s") if what.startswith("error") else what: int(n) for n, what in counted}
    shown = [os.path.relpath(python, REPO) if Path(python).is_relative_to(REPO) else python, *cmd[1:]]
    return {"command": " ".join(shown), "exit": code, "seconds": round(time.time() - start, 1),
            "passed": counts.get("passed", 0), "failed": counts.get("failed", 0), "skipped": counts.get("skipped", 0),
            "errors": counts.get("error", 0), "failed_tests": re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M),
            "tail": "" if code == 0 else out[-3000:]}


# where torch releases differ in what the course shows, asked of the side interpreter by the tests' own probes
BEHAVIOUR = """
import json, sys
sys.path.insert(0, "tests")
from harness import gloo_has_list_all_to_all
from test_05_collectives import raises_on_synced_buffers
print(json.dumps({"gloo_list_all_to_all": gloo_has_list_all_to_all(),
                  "two_forwards_with_synced_buffers_raise": raises_on_synced_buffers()}))
"""


def behaviour(python: str, env: dict) -> dict:
    """What this torch does where releases differ: Gloo's list all_to_all, DDP's synced buffers before a backward."""
    found = subprocess.run([python, "-c", BEHAVIOUR], cwd=REPO, env={**env, "PYTHONPATH": str(REPO)},
                           capture_output=True, text=True, timeout=300)
    if found.returncode != 0:
        return {"error": found.stderr.strip()[-500:]}
    return json.loads(found.stdout.splitlines()[-1])


def record_size(venv: Path, spec: str, record: bool) -> int:
    """What a side environment takes on disk, and how much of it is NVIDIA's CUDA libraries: a record of its own."""
    date = time.strftime("%Y-%m-%d")
    size = {"bench": "compat-size", "torch": spec, "date": date, "packages": [f"torch=={spec}", "torchvision", *TOOLS],
            "venv_gb": disk_gb(venv), "cuda_libraries_gb": disk_gb(venv, "lib/python*/site-packages/nvidia*/**/*"),
            "machine": {"arch": platform.machine(), "cores": os.cpu_count(), "gpus": int(subprocess.run(
                [str(venv / "bin" / "python"), "-c", "import torch; print(torch.cuda.device_count())"],
                capture_output=True, text=True, timeout=120, check=True).stdout)}}
    out_dir = REPO / ("bench/results" if record else "runs/compat")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"compat-size_torch-{spec}_{date}.json"
    path.write_text(json.dumps(size, indent=1) + "\n")
    print(f"torch {spec} with its torchvision and {', '.join(TOOLS)}: {size['venv_gb']} GB, of which NVIDIA's "
          f"libraries {size['cuda_libraries_gb']} GB. Written: {path}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[2:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--torch", help="a torch release from the package index, e.g. 2.11.0")
    which.add_argument("--python", help="an interpreter that already holds torch, torchvision, tqdm and pytest")
    parser.add_argument("--with", dest="extras", default="", help="comma-separated packages the side environment "
                        "also gets, e.g. matplotlib (with --torch)")
    parser.add_argument("--record", action="store_true", help="write the record into bench/results")
    parser.add_argument("--size-only", action="store_true", help="with --torch: record what the side environment "
                        "takes on disk, run nothing (e.g. --torch 2.13.0+cpu, a CPU-only build)")
    args = parser.parse_args(argv)
    if args.size_only and not args.torch:
        parser.error("--size-only goes with --torch: it measures the side environment it builds")
    extras = sorted(filter(None, args.extras.split(",")))
    if extras and not args.torch:
        parser.error("--with goes with --torch: it names what the side environment gets")
    python = str(side_environment(args.torch, extras)) if args.torch else args.python
    if args.size_only:  # a CPU-only torch beside the package index's torchvision does not import it: not asked
        return record_size(Path(python).parent.parent, args.torch, args.record)
    probe = subprocess.run([python, "-c", "import sys, torch, torchvision, importlib.util as u; "
                            "print(torch.__version__, torchvision.__version__, torch.version.cuda, "
                            "sys.version.split()[0], torch.cuda.device_count(), bool(u.find_spec('matplotlib')))"],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        parser.exit(2, f"error: {python} cannot import torch and torchvision: {probe.stderr.strip()[-300:]}\n")
    torch_v, vision_v, cuda, py_v, gpus, matplotlib = probe.stdout.split()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # only what make gives its processes
    env.update(TQDM_DISABLE="1", PYTHONUNBUFFERED="1")
    print(f"the whole suite with {python} (torch {torch_v}), as `make test PY=...` runs it (about 11 minutes on 2 "
          "cores) ...", flush=True)
    suite = run_suite(python, env)
    date = time.strftime("%Y-%m-%d")
    version = torch_v.split("+")[0]
    record = {"bench": "compat", "torch": torch_v, "torchvision": vision_v, "cuda": cuda if cuda != "None" else None,
              "python": py_v, "matplotlib": matplotlib == "True",
              "interpreter": os.path.relpath(python, REPO) if args.torch else "given with --python",
              "date": date, "machine": {"arch": platform.machine(), "cores": os.cpu_count(), "gpus": int(gpus)},
              "all_passed": suite["exit"] == 0 and suite["failed"] == 0 and suite["passed"] > 0, "suite": suite,
              "behaviour": behaviour(python, env)}
    if args.torch:  # what such an environment takes on disk, and how much of it is NVIDIA's CUDA libraries
        venv = Path(python).parent.parent
        record["venv_gb"] = disk_gb(venv)
        record["cuda_libraries_gb"] = disk_gb(venv, "lib/python*/site-packages/nvidia*/**/*")
    out_dir = REPO / ("bench/results" if args.record else "runs/compat")
    out_dir.mkdir(parents=True, exist_ok=True)
    name = out_dir / f"compat_torch-{version}{''.join('-' + e for e in extras)}_{date}"
    md = [f"# The whole suite on torch {torch_v} (torchvision {vision_v}, Python {py_v}"
          f"{', with ' + ', '.join(extras) if extras else ''}), {date}", "",
          f"`{suite['command']}`: {suite['passed']} passed, {suite['failed']} failed, {suite['skipped']} skipped, "
          f"in {suite['seconds'] / 60:.1f} minutes.", *[f"- failed: `{t}`" for t in suite["failed_tests"]]]
    for path, text in ((Path(f"{name}.json"), json.dumps(record, indent=1) + "\n"),
                       (Path(f"{name}.md"), "\n".join(md) + "\n")):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    failed = f"; FAILED: {', '.join(suite['failed_tests'])}" if suite["failed_tests"] else ""
    print(f"torch {torch_v}: {suite['passed']} passed, {suite['failed']} failed, {suite['skipped']} skipped in "
          f"{suite['seconds']:.0f} s{failed}. Written: {name}.json, {name}.md")
    if suite["tail"]:
        print(suite["tail"][-1500:])
    return 0 if record["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
