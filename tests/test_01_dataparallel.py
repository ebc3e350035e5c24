"""Section 01: the single-process baseline and nn.DataParallel."""

import pytest
import torch
from torch import nn

import common
from harness import make, python


@pytest.mark.skipif(torch.cuda.is_available(), reason="DataParallel has a CPU-only path only without a GPU")
def test_dataparallel_without_gpu_returns_exactly_what_the_module_returns():
    model = common.ConvNet().eval()
    wrapped = nn.DataParallel(model)
    x = torch.randn(8, 1, 28, 28)
    assert wrapped.device_ids == []
    assert torch.equal(wrapped(x), model(x))
    keys = list(wrapped.state_dict())
    assert keys and all(k.startswith("module.") for k in keys), "the wrapper prefixes every key"
    plain = common.ConvNet()
    with pytest.raises(RuntimeError, match="Unexpected key"):
        plain.load_state_dict(wrapped.state_dict())
    plain.load_state_dict(wrapped.module.state_dict())  # unwrapping gives plain keys


def test_dp_shapes_prints_the_split_it_would_make():
    out = make("dp-shapes").stdout
    if torch.cuda.device_count() >= 2:
        pytest.skip("covered by the CUDA test on a machine with 2+ GPUs")
    assert out.count("would run on cuda:0: input size [15, 5]") == 3
    assert out.count("would run on cuda:1: input size [5, 5] output size [5, 2]") == 1
    assert out.count("Outside: input size [30, 5] output size [30, 2]") == 3
    assert "Outside: input size [10, 5] output size [10, 2]" in out


@pytest.mark.cuda
def test_dp_shapes_on_two_gpus_match_the_split():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    out = python("01_dataparallel/dataparallel_shapes.py", "--gpus", "2").stdout
    assert out.count("In Model on cuda:0: input size [15, 5] output size [15, 2]") == 3
    assert out.count("In Model on cuda:1: input size [15, 5] output size [15, 2]") == 3
    assert out.count("In Model on cuda:1: input size [5, 5] output size [5, 2]") == 1


@pytest.mark.slow
def test_make_dataparallel_trains_and_saves_a_plain_state_dict(data_dir, tmp_path):
    res = make("dataparallel", "EPOCHS=1",
               f"ARGS=--dataset mnist-standin --data-dir {data_dir} --max-steps 60 --checkpoint-dir {tmp_path}")
    assert res.final["test_samples"] == 4000 and res.final["world_size"] == 1
    assert res.final["test_acc"] > 0.5
    if not torch.cuda.is_available():
        assert "calls the model directly" in res.stdout and res.final["replicas"] == 1
    state = torch.load(tmp_path / "mnist_dataparallel.pt", weights_only=True)
    common.ConvNet().load_state_dict(state["model"])  # no "module." prefix


def test_dataparallel_refuses_gpu_flags_without_gpus():
    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    res = python("01_dataparallel/mnist_dataparallel.py", "--gpus", "0,1", expect_rc=2)
    assert "need CUDA GPUs" in res.stderr and "Traceback" not in res.stderr
