"""Section 01: the single-process baseline and nn.DataParallel."""

import pytest
import torch
from torch import nn

import common
from harness import PYTHON, make, python, run

NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}  # the CPU path on any machine, GPUs or not


def test_dataparallel_prefixes_every_key_and_module_unwraps_them():
    wrapped = nn.DataParallel(common.ConvNet())
    keys = list(wrapped.state_dict())
    assert keys and all(k.startswith("module.") for k in keys), "the wrapper prefixes every key"
    plain = common.ConvNet()
    with pytest.raises(RuntimeError, match="Unexpected key"):
        plain.load_state_dict(wrapped.state_dict())
    plain.load_state_dict(wrapped.module.state_dict())  # unwrapping gives plain keys


DP_WITHOUT_GPU = """
import torch
from torch import nn
import common
model = common.ConvNet().eval()
wrapped = nn.DataParallel(model)
x = torch.randn(8, 1, 28, 28)
print("device_ids", wrapped.device_ids, "same output", torch.equal(wrapped(x), model(x)))
"""


def test_dataparallel_without_gpu_returns_exactly_what_the_module_returns():
    out = run([PYTHON, "-c", DP_WITHOUT_GPU], env=NO_GPU).stdout
    assert "device_ids [] same output True" in out


def test_dp_shapes_prints_the_split():
    out = make("dp-shapes", "ARGS=--gpus 2").stdout
    if common.gpu_count() >= 2:  # a real split over two GPUs, each replica reporting from its thread
        assert out.count("In Model on cuda:0: input size [15, 5] output size [15, 2]") == 3
        assert out.count("In Model on cuda:1: input size [15, 5] output size [15, 2]") == 3
        assert out.count("In Model on cuda:1: input size [5, 5] output size [5, 2]") == 1
    else:  # fewer than 2 GPUs: what DataParallel would do, computed with torch.chunk
        assert out.count("would run on cuda:0: input size [15, 5]") == 3
        assert out.count("would run on cuda:1: input size [5, 5] output size [5, 2]") == 1
    assert out.count("Outside: input size [30, 5] output size [30, 2]") == 3
    assert "Outside: input size [10, 5] output size [10, 2]" in out


@pytest.mark.slow
def test_make_dataparallel_trains_and_saves_a_plain_state_dict(data_dir, tmp_path):
    res = make("dataparallel", "EPOCHS=1",
               f"ARGS=--dataset mnist-standin --data-dir {data_dir} --max-steps 60 --checkpoint-dir {tmp_path}")
    assert res.final["test_samples"] == 4000 and res.final["world_size"] == 1
    assert res.final["test_acc"] > 0.5
    gpus = common.gpu_count()
    assert res.final["replicas"] == max(1, gpus)
    if not gpus:
        assert "calls the model directly" in res.stdout
    state = torch.load(tmp_path / "mnist_dataparallel.pt", weights_only=True)
    common.ConvNet().load_state_dict(state["model"])  # no "module." prefix


def test_dataparallel_refuses_gpus_that_are_not_there():
    gpus = common.gpu_count()
    if gpus == 0:
        res = python("01_dataparallel/mnist_dataparallel.py", "--gpus", "0,1", expect_rc=2)
        assert "need CUDA GPUs" in res.stderr
    else:
        res = python("01_dataparallel/mnist_dataparallel.py", "--gpus", f"0,{gpus}", expect_rc=2)
        assert f"GPU {gpus} does not exist: this machine has {gpus}" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.slow
@pytest.mark.multigpu
def test_one_gpu_dataparallel_refuses_another_output_device():
    """With one device, DataParallel calls the module and gathers nothing: outputs stay on that GPU."""
    res = python("01_dataparallel/mnist_dataparallel.py", "--gpus", "0", "--output-device", "1", expect_rc=2)
    assert "--output-device must be that GPU" in res.stderr and "Traceback" not in res.stderr
