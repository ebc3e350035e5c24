"""nbval runs each notebook's cells in order; with 2 pytest workers (make test) a notebook, whose cells start up
to 4 processes, runs while the other worker waits (tests/harness.py, cores)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from harness import cores  # noqa: E402

_held = {}


def pytest_runtest_setup(item):
    _held[item.nodeid] = cores(alone=True)
    _held[item.nodeid].__enter__()


def pytest_runtest_teardown(item):
    held = _held.pop(item.nodeid, None)
    if held is not None:
        held.__exit__(None, None, None)
