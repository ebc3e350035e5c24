"""The notebooks: each .ipynb is its .py source plus outputs, and the outputs compare equal on any machine
(another host name, other paths, GPUs)."""

import jupytext
import nbformat
import pytest
from nbval.plugin import get_sanitize_patterns

from harness import REPO

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
torchrun gave 2 processes, 2 on this node; restart 0
training ConvNet on mnist-standin (24000 train / 4000 test images) with 2 process(es) on cpu, batch 64 per process
training ConvNet on mnist-standin (24000 train / 4000 test images) on cpu, batch 64, 1 epoch(s)
rank 3 (node 1, local rank 1) of 4 joined via tcp on vm
resumed from /tmp/tmpcmw46pzm/elastic/recovered/mnist_torchrun.pt after epoch 1
final: test_acc=0.9712 test_samples=4000 world_size=2 epochs=3 seconds=12.5 dataset=mnist-standin weights=8c56478f \
ranks_agree=True restarts=0
"""

ELSEWHERE = """\
torch 2.14.1+cu130 (CUDA 13.0), 8 GPU(s): NVIDIA H100 80GB HBM3; this run: 2 process(es) per node on cuda with nccl
NOTE: THIS RUN USES THE CPU although 8 GPU(s) are visible: --device cpu was asked for.
torchrun gave 2 processes, 2 on this node; restart 0
training ConvNet on mnist-standin (24000 train / 4000 test images) with 2 process(es) on cuda, batch 64 per process
training ConvNet on mnist-standin (24000 train / 4000 test images) on cuda:0, batch 64, 1 epoch(s)
rank 3 (node 1, local rank 1) of 4 joined via tcp on gpu-node-17
resumed from /scratch/job-881/elastic/recovered/mnist_torchrun.pt after epoch 1
final: test_acc=0.9698 test_samples=4000 world_size=2 epochs=3 seconds=3.1 dataset=mnist-standin weights=0a1b2c3d \
ranks_agree=True restarts=0
"""


def test_output_from_another_host_and_device_compares_equal():
    assert sanitize(ELSEWHERE) == sanitize(SAVED_HERE)


def test_what_the_lesson_is_about_still_compares():
    """Counts, world sizes, ranks and data set names are not masked: a change there must fail the notebook."""
    for changed in (SAVED_HERE.replace("test_samples=4000", "test_samples=4002"),
                    SAVED_HERE.replace("world_size=2", "world_size=1"),
                    SAVED_HERE.replace("rank 3 (node 1", "rank 2 (node 1"),
                    SAVED_HERE.replace("restart 0", "restart 1"),
                    SAVED_HERE.replace("ranks_agree=True", "ranks_agree=False")):
        assert sanitize(changed) != sanitize(SAVED_HERE)
