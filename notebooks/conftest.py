"""`make test` runs the notebooks (nbval) in the same pytest-xdist run as tests/.

All cells of a notebook go to one worker, in order, so they run in one kernel. A cell that starts
training processes shares the cores as the tests do (tests/harness.py: cores): it holds the shared lock, or the
lock alone when it starts 3 or more processes at once.
"""

import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import harness  # noqa: E402

MANY = re.compile(r"NPROC=[3-9]|NNODES=[2-9]|--nproc [3-9]")  # 3 or more processes at once


def pytest_xdist_make_scheduler(config, log):
    """Every cell of a notebook to the same worker, in order; every other test on its own."""
    from xdist.scheduler import LoadScopeScheduling

    class NotebooksWhole(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if path.endswith(".ipynb") else nodeid

    return NotebooksWhole(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    source = getattr(getattr(item, "cell", None), "source", "")
    if not (item.path.suffix == ".ipynb" and "run(" in source):
        yield
        return
    with harness.cores(alone=bool(MANY.search(source))):
        yield
