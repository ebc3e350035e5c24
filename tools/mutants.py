"""Break the distributed part of a script on purpose and check that a test goes red: proof that the tests test it.

    python tools/mutants.py                      # every mutation (about 3 minutes on 2 cores)
    python tools/mutants.py --only drop-set-epoch
    make mutants

Each mutation replaces one piece of 02_ddp_spawn/mnist_spawn.py (the sampler, set_epoch, the DDP wrap, the
evaluation all_reduce, the buffer broadcast before evaluation) in a copy of the repository, then runs the tests
that guard it there. First the same tests run on the unchanged copy, which must pass. A mutation is "caught" when
at least one of its tests fails; the record (bench/results/mutants_<date>.json and .md unless --output-dir says
otherwise) lists what failed and the assertion that said so, and the sha256 of the script and its tests: the
test of the record fails once either changes, until `make mutants` runs again. Exit code 1 if a mutation survives.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = "02_ddp_spawn/mnist_spawn.py"
HEADLINE = ("tests/test_02_ddp_spawn.py::"
            "test_headline_spawn_run_reaches_97_percent_with_disjoint_shards_and_equal_weights")

MUTANTS = {  # name: (what it breaks, the original code, the mutated code, the tests that must catch it)
    "drop-set-epoch": ("every epoch repeats the first epoch's order",
                       "        sampler.set_epoch(epoch)", "        pass", [HEADLINE]),
    "drop-the-sampler": ("every rank trains on the whole data set",
                         "sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,",
                         "sampler = DistributedSampler(train_set, num_replicas=1, rank=0,", [HEADLINE]),
    "bare-model-instead-of-DDP": (
        "no gradient is averaged: each rank trains its own model",
        '    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)',
        "    bare = torch.nn.Module()\n    bare.module = model\n    bare.forward = lambda x: bare.module(x)\n"
        "    model = bare", [HEADLINE]),
    "drop-eval-all_reduce": ("each rank reports the accuracy of its own part of the test set",
                             "        dist.all_reduce(totals)", "        pass", [HEADLINE]),
    "drop-buffer-broadcast": ("the ranks' BatchNorm statistics differ after the last step",
                              "            dist.broadcast(buffer, src=0)", "            pass", [HEADLINE]),
}


def copy_repo(dest: Path) -> None:
    """The tracked files (times kept, so that make sees nothing new) and the same virtualenv."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split()
    for name in files:
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    (dest / ".venv").symlink_to(REPO / ".venv")


def sources() -> dict:
    """sha256 of the mutated script and of the test files that guard it: a record is current only for these."""
    files = [SCRIPT] + sorted({t.split("::")[0] for m in MUTANTS.values() for t in m[3]})
    return {name: hashlib.sha256((REPO / name).read_bytes()).hexdigest() for name in files}


def run_tests(where: Path, tests: list[str]) -> dict:
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=where,
                          capture_output=True, text=True, timeout=900)
    failed = re.findall(r"^FAILED (\S+)", proc.stdout, re.M)
    lines = proc.stdout.splitlines()
    # the failing statement (pytest marks it with ">") and the first line of what it said
    where = [ln[1:].strip() for ln in lines if ln.startswith(">") and "assert" in ln][:1]
    said = [ln[2:].strip() for ln in lines if ln.startswith("E ")][:1]
    return {"exit_code": proc.returncode, "failed": failed, "assertion": " / ".join(where + said),
            "seconds": round(time.time() - start, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated mutation names (default: all)")
    parser.add_argument("--output-dir", default="bench/results")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(MUTANTS)
    if set(names) - set(MUTANTS):
        parser.error(f"--only: unknown {sorted(set(names) - set(MUTANTS))}; choose from {', '.join(MUTANTS)}")
    record = {"script": SCRIPT, "date": time.strftime("%Y-%m-%d %H:%M"), "sources": sources(), "mutants": {}}
    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        copy = Path(tmp)
        copy_repo(copy)
        target = copy / SCRIPT
        original = target.read_text()
        tests = sorted({t for n in names for t in MUTANTS[n][3]})
        print(f"--- unchanged: {len(tests)} test(s)", flush=True)
        record["unchanged"] = run_tests(copy, tests)
        if record["unchanged"]["exit_code"] != 0:
            print(f"the tests fail without any mutation: {record['unchanged']}", file=sys.stderr)
            return 1
        for name in names:
            what, before, after, guards = MUTANTS[name]
            if original.count(before) != 1:
                print(f"{name}: the code to mutate is not in {SCRIPT} exactly once: {before!r}", file=sys.stderr)
                return 1
            target.write_text(original.replace(before, after))
            result = run_tests(copy, guards)
            target.write_text(original)
            result.update(breaks=what, caught=result["exit_code"] != 0)
            record["mutants"][name] = result
            verdict = f"caught by {', '.join(result['failed'])}" if result["caught"] else "SURVIVED"
            print(f"--- {name} ({what}): {verdict}\n    {result['assertion'][:200]}", flush=True)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"mutants_{time.strftime('%Y-%m-%d')}"
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    lines = [f"# Mutations of {SCRIPT} and the tests that catch them", "",
             f"{record['date']}; the unchanged copy passed the same tests in {record['unchanged']['seconds']} s.", "",
             "| mutation | what it breaks | caught | failed test | the assertion |", "|---|---|---|---|---|"]
    for name, r in record["mutants"].items():
        lines.append(f"| {name} | {r['breaks']} | {'yes' if r['caught'] else 'NO'} | "
                     f"{', '.join(t.split('::')[-1] for t in r['failed'])} | `{r['assertion'][:120]}` |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"written: {stem}.json, {stem}.md")
    return 0 if all(r["caught"] for r in record["mutants"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
