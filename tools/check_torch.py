"""Say which torch an existing interpreter holds, and refuse one the course cannot run on: `make ... PY=python3`.

    python tools/check_torch.py      # exit 0 with one line on what was found, 2 with one line on what is missing

For machines where the course's own .venv cannot be built (a cluster's module, a container image, a GPU machine
without a package index). The course is tested with the pinned torch of requirements.txt; older releases from
2.4 on have every API it uses, and the line says what differs.
"""

import importlib.util
import re
import sys
from pathlib import Path

OLDEST = (2, 4)


def version(text: str) -> tuple[int, int]:
    found = re.match(r"(\d+)\.(\d+)", text)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def main() -> int:
    pinned = re.search(r"^torch==(\S+)", (Path(__file__).resolve().parents[1] / "requirements.txt").read_text(), re.M)
    pinned = pinned.group(1) if pinned else "?"
    if importlib.util.find_spec("torch") is None:
        print(f"error: {sys.executable} has no torch; install torch=={pinned} or run `make setup`", file=sys.stderr)
        return 2
    import torch

    if version(torch.__version__) < OLDEST:
        print(f"error: {sys.executable} has torch {torch.__version__}; the course needs {OLDEST[0]}.{OLDEST[1]} or "
              f"newer (tested with {pinned})", file=sys.stderr)
        return 2
    missing = [name for name in ("tqdm", "pytest", "torchvision") if importlib.util.find_spec(name) is None]
    differs = "" if torch.__version__.split("+")[0] == pinned else f"; the course is tested with {pinned}"
    print(f"using {sys.executable}: torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}){differs}"
          + (f"; missing: {', '.join(missing)}" if missing else ""))
    return 2 if "tqdm" in missing else 0


if __name__ == "__main__":
    sys.exit(main())
