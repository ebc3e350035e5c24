import fcntl
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py, also without `make setup`

import harness  # noqa: E402
from tools import course, data  # noqa: E402


@pytest.hookimpl(tryfirst=True)  # before -m and -k deselect anything
def pytest_collection_modifyitems(config, items):
    """`cuda` tests need one usable GPU, `multigpu` tests two; elsewhere they are skipped, with the reason."""
    harness.COLLECTED.update({item.nodeid: any(item.get_closest_marker(m) for m in ("cuda", "multigpu"))
                              for item in items})
    gpus = course.gpu_count()
    needs = {"cuda": 1, "multigpu": 2}
    for item in items:
        for marker, count in needs.items():
            if marker in item.keywords and gpus < count:
                item.add_marker(pytest.mark.skip(reason=f"needs {count} usable CUDA GPU(s); this machine has {gpus}"))


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """A data folder with both offline stand-ins, made once per test run."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # made once for all workers of this run
    root = shared / "data"
    with open(shared / "data.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one worker writes, the others wait and find it complete
        data.prepare("mnist-standin", root, quiet=True)
        data.prepare("cifar10-standin", root, family="cifar10", quiet=True)
    return root


@pytest.fixture(autouse=True)
def _share_the_cores(request):
    """Tests that start processes share the cores with the other pytest worker, if any (harness.cores)."""
    alone = request.node.get_closest_marker("ranks") is not None
    if not (alone or request.node.get_closest_marker("slow")):
        yield
        return
    with harness.cores(alone):
        yield
