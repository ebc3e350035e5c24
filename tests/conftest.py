import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py, also without `make setup`

import common  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; torch.cuda.is_available() is False on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """A data folder with both offline stand-ins, made once per test session."""
    root = tmp_path_factory.mktemp("data")
    common.prepare_data("mnist-standin", root, quiet=True)
    common.prepare_data("cifar10-standin", root, family="cifar10", quiet=True)
    return root
