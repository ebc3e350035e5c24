"""The notebooks: each .ipynb is its .py source plus outputs, and the outputs compare equal on any machine
(another host name, other paths, GPUs)."""

import pytest

# make test PY=... with an interpreter that has no notebook tools says so and runs the rest
jupytext = pytest.importorskip("jupytext", reason="the notebook tests need jupytext, nbformat and nbval")
import nbformat  # noqa: E402
from nbval.plugin import get_sanitize_patterns  # noqa: E402

from harness import REPO  # noqa: E402

SOURCES = sorted((REPO / "notebooks").glob("0*.py"))


def cells(notebook) -> list[tuple]:
    return [(c.cell_type, c.source.strip(), tuple(c.metadata.get("tags", ()))) for c in notebook.cells]


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_each_notebook_is_its_source_with_outputs(source):
    """Edit the .py, then `make notebooks` (or `make notebooks NB=<name>.py`) writes and runs the .ipynb."""
    paired = source.with_suffix(".ipynb")
    assert paired.exists(), f"{paired.name} is missing: run make notebooks NB={source.name}"
    saved = nbformat.read(paired, as_version=4)
    assert cells(saved) == cells(jupytext.read(source)), f"{paired.name} is stale: make notebooks NB={source.name}"
    code = [c for c in saved.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code), f"{paired.name} was not executed: make notebooks"
    assert not any(o.get("output_type") == "error" for c in code for o in c.outputs), f"{paired.name} has errors"


def test_every_notebook_has_a_source():
    assert {p.stem for p in (REPO / "notebooks").glob("0*.ipynb")} == {p.stem for p in SOURCES}


PATTERNS = get_sanitize_patterns((REPO / "tests" / "nbval_sanitize.cfg").read_text())


def sanitize(text: str) -> str:
    import re

    for regex, replace in PATTERNS:  # what nbval does to both the saved and the fresh output
        text = re.sub(regex, replace, text)
    return text


SAVED_HERE = """\
torch 2.14.1+cu130 (CUDA 13.0), no CUDA GPU visible; this run: 2 process(es) per node on cpu with gloo
2 processes, 2 on this node, on cpu with gloo
2 processes on cpu with gloo, amp bf16, sync-bn True
1 process on cpu
rank 3 (local rank 1) of 4 joined via tcp://127.0.0.1:38771
resumed from /tmp/tmpcmw46pzm/elastic/recovered/mnist_torchrun.pt after epoch 1
epoch 1/3: train_loss=0.1234 test_loss=0.2345 test_acc=0.9712
rank 0, epoch 1: 12000 samples, first [44, 18931, 16511, 643, 6233]
ddp: ok (every rank trains a DDP model and ends with the same weights)
final: test_acc=0.9712 test_samples=4000 world_size=2 epochs=3 seconds=12.5 dataset=mnist-standin
final: test_acc=0.9690 test_samples=4000 world_size=2 epochs=1 seconds=20.5 dataset=mnist-standin amp=bf16 sync_bn=True
"""

ELSEWHERE = """\
torch 2.14.1+cu130 (CUDA 13.0), 8 GPU(s): NVIDIA H100 80GB HBM3; this run: 2 process(es) per node on cuda with nccl
NOTE: THIS RUN USES THE CPU although 8 GPU(s) are visible: --device cpu was asked for.
2 processes, 2 on this node, on cuda with nccl
2 processes on cuda with nccl, amp fp16, sync-bn True
1 process on cuda
rank 3 (local rank 1) of 4 joined via tcp://10.1.0.17:29500
resumed from /scratch/job-881/elastic/recovered/mnist_torchrun.pt after epoch 1
epoch 1/3: train_loss=0.1301 test_loss=0.2297 test_acc=0.9698
rank 0, epoch 1: 12000 samples, first [44, 18931, 16511, 643, 6233]
ddp: ok (every rank trains a DDP model and ends with the same weights)
final: test_acc=0.9698 test_samples=4000 world_size=2 epochs=3 seconds=3.1 dataset=mnist-standin
final: test_acc=0.9701 test_samples=4000 world_size=2 epochs=1 seconds=4.2 dataset=mnist-standin amp=fp16 sync_bn=True
"""


def test_output_from_another_host_and_device_compares_equal():
    assert sanitize(ELSEWHERE) == sanitize(SAVED_HERE)


def test_what_the_lesson_is_about_still_compares():
    """Counts, world sizes, ranks and data set names are not masked: a change there must fail the notebook."""
    for changed in (SAVED_HERE.replace("test_samples=4000", "test_samples=4002"),
                    SAVED_HERE.replace("world_size=2", "world_size=1"),
                    SAVED_HERE.replace("rank 3 (local rank 1", "rank 2 (local rank 1"),
                    SAVED_HERE.replace("epoch 1/3", "epoch 2/3"),
                    SAVED_HERE.replace("12000 samples", "12001 samples"),
                    SAVED_HERE.replace("sync_bn=True", "sync_bn=False"),
                    SAVED_HERE.replace("ddp: ok", "ddp: wrong")):
        assert sanitize(changed) != sanitize(SAVED_HERE)
