import fcntl
import gc
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py, also without `make setup`

import harness  # noqa: E402 - first: it sets OMP_WAIT_POLICY before anything imports torch
from harness import TEST_IMAGES  # noqa: E402
from tools import data, standins  # noqa: E402
from tools.standins import STANDIN_SIZES  # noqa: E402


@pytest.hookimpl(tryfirst=True)  # before -m and -k deselect anything
def pytest_collection_modifyitems(config, items):
    """`cuda` tests need one usable GPU, `multigpu` tests two; elsewhere they are skipped, with the reason. The
    tests that start processes run first."""
    harness.COLLECTED.update({item.nodeid: any(item.get_closest_marker(m) for m in ("cuda", "multigpu"))
                              for item in items})
    import common

    gpus = common.usable_gpus()
    needs = {"cuda": 1, "multigpu": 2}
    for item in items:
        for marker, count in needs.items():
            if marker in item.keywords and gpus < count:
                item.add_marker(pytest.mark.skip(reason=f"needs {count} usable CUDA GPU(s); this machine has {gpus}"))
    # the order the tests are handed out in (harness.hand_out_order: the order within each group, and of a
    # notebook's cells, stays)
    harness.hand_out_order(items)
    harness.KINDS[:] = [harness.kind(item) for item in items]
    harness.WAITS[:] = [harness.waits(item) for item in harness.handed_out(items)]


def pytest_collection_finish(session):
    """What is alive once the tests are collected (torch, the test modules) stays alive to the end: the collector
    stops walking it at every full collection: about 7 % of the in-process tests' CPU time (measured 2026-11-27;
    with the mutation check's own gc.freeze, `make test` went from 525-534 s to 522-524 s on 2 cores)."""
    gc.freeze()


def _made_once(tmp_path_factory, name: str, make) -> Path:
    """A folder made by make(folder) once for the whole run: the first pytest worker writes, the others wait."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # made once for all workers of this run
    root = shared / name
    with open(shared / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one worker writes, the others wait and find it complete
        if not root.exists():
            partial = shared / f"{name}.partial"  # complete or absent: a worker that fails midway leaves no half
            make(partial)
            partial.rename(root)
    return root


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """The data folder of the training runs: both offline stand-ins with their whole training sets, and smaller
    test sets (harness.TEST_IMAGES MNIST images): every run evaluates, and a run whose claim is about the full
    4,000 uses standin_dir instead."""
    def make(root):
        standins.write_mnist_standin(root / data.STANDIN_SUBDIR, sizes=(STANDIN_SIZES["mnist"][0], TEST_IMAGES))
        standins.write_cifar_standin(root / data.STANDIN_SUBDIR, sizes=(2000, 400))  # ResNet-18 runs a few steps
    return _made_once(tmp_path_factory, "data", make)


@pytest.fixture(scope="session")
def standin_dir(tmp_path_factory):
    """Both stand-ins exactly as a user's first run makes them (data.prepare), at their full sizes."""
    def make(root):
        data.prepare("mnist-standin", root, quiet=True)
        data.prepare("cifar10-standin", root, family="cifar10", quiet=True)
    return _made_once(tmp_path_factory, "standin-data", make)


@pytest.fixture(scope="session")
def bare(tmp_path_factory):
    """`PY=` for make: an interpreter that holds torch but not the course (harness.bare_python), checked to be so."""
    def make(root):  # made once for all workers of this run
        python = harness.bare_python(root)
        found = harness.run([python, "-c", "import importlib.util as u, torch; print(u.find_spec('common'))"],
                            cwd=tmp_path_factory.mktemp("elsewhere"), env=harness.BARE_ENV)
        assert found.stdout.strip() == "None", found.tail()  # torch imports, the course does not
    return str(_made_once(tmp_path_factory, "bare-python", make) / "bin" / "python")


@pytest.fixture(autouse=True)
def _share_the_cores(request):
    """Tests that start processes share the cores with the other pytest worker, if any (harness.cores); a test
    whose processes mostly wait on a timeout (marked waits) runs beside anything: it would only hold others up."""
    alone = request.node.get_closest_marker("ranks") is not None
    if request.node.get_closest_marker("waits") or not (alone or request.node.get_closest_marker("slow")):
        yield
        return
    with harness.cores(alone):
        yield
