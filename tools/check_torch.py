"""Say which torch an existing interpreter holds, and refuse one the course cannot run on: `make ... PY=python3`.

    python tools/check_torch.py      # exit 0 with one line on what was found, 2 with one line on what is missing

For machines where the course's own .venv cannot be built (a cluster's module, a container image, a GPU machine
without a package index). The course runs on the torch versions it has been run on: the oldest is OLDEST (its
record: bench/results/compat_torch-*), the newest the pinned one of requirements.txt. It reads the installed
packages' metadata and imports nothing, so it costs no torch start-up.
"""

import argparse
import importlib.metadata
import importlib.util
import re
import sys
from pathlib import Path

OLDEST = (2, 11)  # `make compat TORCH=2.11.0` ran the course on it: bench/results/compat_torch-2.11.0_*.json


def version(text: str) -> tuple[int, int]:
    found = re.match(r"(\d+)\.(\d+)", text)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def main() -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    pinned = re.search(r"^torch==(\S+)", (Path(__file__).resolve().parents[1] / "requirements.txt").read_text(), re.M)
    pinned = pinned.group(1) if pinned else "?"
    torch = installed("torch") if importlib.util.find_spec("torch") else None
    if torch is None:
        print(f"error: {sys.executable} has no torch; install torch=={pinned} or run `make setup`", file=sys.stderr)
        return 2
    if version(torch) < OLDEST:
        print(f"error: {sys.executable} has torch {torch}; the course runs on {OLDEST[0]}.{OLDEST[1]} to {pinned} "
              f"(the versions it has been run on)", file=sys.stderr)
        return 2
    missing = [name for name in ("tqdm", "pytest", "torchvision") if importlib.util.find_spec(name) is None]
    differs = "" if torch.split("+")[0] == pinned else f"; the course is tested with {pinned}"
    print(f"using {sys.executable}: torch {torch}{differs}" + (f"; missing: {', '.join(missing)}" if missing else ""))
    return 2 if "tqdm" in missing else 0


if __name__ == "__main__":
    sys.exit(main())
