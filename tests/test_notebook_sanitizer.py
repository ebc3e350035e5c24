"""The notebooks' saved outputs must compare equal on any machine: another host name, other paths, GPUs."""

from nbval.plugin import get_sanitize_patterns

from harness import REPO

PATTERNS = get_sanitize_patterns((REPO / "tests" / "nbval_sanitize.cfg").read_text())


def sanitize(text: str) -> str:
    import re

    for regex, replace in PATTERNS:  # what nbval does to both the saved and the fresh output
        text = re.sub(regex, replace, text)
    return text


SAVED_HERE = """\
torch 2.14.1+cu130 (CUDA 13.0), no CUDA GPU visible; this run: 2 process(es) per node on cpu with gloo
torchrun gave 2 processes, 2 on this node; restart 0
training ConvNet on mnist-standin (24000 train / 4000 test images) with 2 processes (gloo, cpu), batch 64 per process
training ConvNet on mnist-standin (24000 train / 4000 test images) on cpu, batch 64, 1 epoch(s)
rank 3 (node 1, local rank 1) of 4 joined via tcp on vm
resumed from /tmp/tmpcmw46pzm/elastic/recovered/mnist_torchrun.pt after epoch 1
final: test_acc=0.9712 test_samples=4000 world_size=2 epochs=3 seconds=12.5 dataset=mnist-standin restarts=0
"""

ELSEWHERE = """\
torch 2.14.1+cu130 (CUDA 13.0), 8 GPU(s): NVIDIA H100 80GB HBM3; this run: 2 process(es) per node on cuda with nccl
NOTE: THIS RUN USES THE CPU although 8 GPU(s) are visible: --device cpu was asked for.
torchrun gave 2 processes, 2 on this node; restart 0
training ConvNet on mnist-standin (24000 train / 4000 test images) with 2 processes (nccl, cuda), batch 64 per process
training ConvNet on mnist-standin (24000 train / 4000 test images) on cuda:0, batch 64, 1 epoch(s)
rank 3 (node 1, local rank 1) of 4 joined via tcp on gpu-node-17
resumed from /scratch/job-881/elastic/recovered/mnist_torchrun.pt after epoch 1
final: test_acc=0.9698 test_samples=4000 world_size=2 epochs=3 seconds=3.1 dataset=mnist-standin restarts=0
"""


def test_output_from_another_host_and_device_compares_equal():
    assert sanitize(ELSEWHERE) == sanitize(SAVED_HERE)


def test_what_the_lesson_is_about_still_compares():
    """Counts, world sizes, ranks and data set names are not masked: a change there must fail the notebook."""
    for changed in (SAVED_HERE.replace("test_samples=4000", "test_samples=4002"),
                    SAVED_HERE.replace("world_size=2", "world_size=1"),
                    SAVED_HERE.replace("rank 3 (node 1", "rank 2 (node 1"),
                    SAVED_HERE.replace("restart 0", "restart 1")):
        assert sanitize(changed) != sanitize(SAVED_HERE)
