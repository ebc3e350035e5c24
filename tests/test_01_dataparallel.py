"""Section 01: the single-process baseline and nn.DataParallel."""

import re

import pytest
import torch
from torch import nn

import common
from harness import PYTHON, REPO, TEST_IMAGES, exits, in_fork, make, python, run
from tools import course

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
import warnings
import torch
from torch import nn
import common
model = common.ConvNet().eval()
x = torch.randn(8, 1, 28, 28)
with warnings.catch_warnings(record=True) as warned:
    warnings.simplefilter("always")
    wrapped = nn.DataParallel(model)
    same = torch.equal(wrapped(x), model(x))
print("device_ids", wrapped.device_ids, "same output", same, "warnings", len(warned))
"""


def test_dataparallel_without_gpu_returns_exactly_what_the_module_returns():
    out = in_fork(DP_WITHOUT_GPU, env=NO_GPU).stdout
    assert "device_ids [] same output True warnings 0" in out  # no copy, no split, no warning


def test_the_convnet_is_the_one_of_kai_zhangs_tutorial():
    """Two blocks of 5x5 convolution (padding 2), BatchNorm, ReLU and 2x2 max-pool (1 -> 16 -> 32 channels), then
    one linear layer from 7 x 7 x 32 features to the 10 classes: the tutorial's ConvNet, layer for layer."""
    net = common.ConvNet()
    for block, (c_in, c_out) in ((net.layer1, (1, 16)), (net.layer2, (16, 32))):
        conv, norm, act, pool = block
        assert (conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding) == \
            (c_in, c_out, (5, 5), (1, 1), (2, 2))
        assert isinstance(norm, nn.BatchNorm2d) and norm.num_features == c_out and isinstance(act, nn.ReLU)
        assert isinstance(pool, nn.MaxPool2d) and (pool.kernel_size, pool.stride) == (2, 2)
    assert (net.fc.in_features, net.fc.out_features) == (7 * 7 * 32, 10)
    assert net(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


def test_dp_shapes_prints_the_split():
    out = make("dp-shapes", "ARGS=--gpus 2").stdout
    if common.usable_gpus() >= 2:  # a real split over two GPUs, each replica reporting from its thread
        assert out.count("In Model on cuda:0: input size [15, 5] output size [15, 2]") == 3
        assert out.count("In Model on cuda:1: input size [15, 5] output size [15, 2]") == 3
        assert out.count("In Model on cuda:1: input size [5, 5] output size [5, 2]") == 1
    else:  # fewer than 2 GPUs: what DataParallel would do, computed with torch.chunk
        assert out.count("would run on cuda:0: input size [15, 5]") == 3
        assert out.count("would run on cuda:1: input size [5, 5] output size [5, 2]") == 1
    assert out.count("Outside: input size [30, 5] output size [30, 2]") == 3
    assert "Outside: input size [10, 5] output size [10, 2]" in out


def dataparallel_run(data_dir, tmp_path, env=None, args=""):
    res = make("dataparallel", "EPOCHS=1", f"ARGS=--dataset mnist-standin --data-dir {data_dir} --max-steps 60 "
               f"--checkpoint-dir {tmp_path} {args}", env=env)
    assert res.final["test_samples"] == TEST_IMAGES and res.final["world_size"] == 1
    assert res.final["test_acc"] > 0.5
    state = torch.load(tmp_path / "mnist_dataparallel.pt", weights_only=True, map_location="cpu")
    common.ConvNet().load_state_dict(state["model"])  # no "module." prefix
    return res


@pytest.mark.slow
def test_make_dataparallel_trains_and_saves_a_plain_state_dict(data_dir, tmp_path):
    res = dataparallel_run(data_dir, tmp_path, env=NO_GPU)  # the CPU path on any machine
    assert "nothing is split" in res.stdout and "nn.DataParallel over" not in res.stdout
    # the README's sample: the line that names the device says that nothing is split, then the epochs, then final
    assert re.search(r"^1 process on cpu: without a usable GPU nothing is split, and the plain model trains$",
                     res.stdout, re.M), res.stdout
    assert re.search(r"^epoch 1/1: train_loss=[\d.]+ test_loss=[\d.]+ test_acc=[\d.]+$", res.stdout, re.M)
    assert res.final["dataset"] == "mnist-standin" and res.final["epochs"] == 1


@pytest.mark.slow
@pytest.mark.cuda
def test_make_dataparallel_on_the_gpus_present(data_dir, tmp_path):
    gpus = common.usable_gpus()
    res = dataparallel_run(data_dir, tmp_path)
    assert f"nn.DataParallel over GPUs {list(range(gpus))}: " + (
        f"each batch of 64 is split {gpus} ways" if gpus > 1 else "one GPU, nothing is split") in res.stdout


@pytest.mark.slow
@pytest.mark.multigpu
def test_make_dataparallel_gathers_on_another_output_device(data_dir, tmp_path):
    """--output-device 1: the outputs are gathered on cuda:1, the labels go there too (training and evaluation)."""
    res = dataparallel_run(data_dir, tmp_path, args="--gpus 0,1 --output-device 1")
    assert "nn.DataParallel over GPUs [0, 1]: each batch of 64 is split 2 ways" in res.stdout


@pytest.mark.multigpu
def test_evaluate_counts_outputs_gathered_on_another_gpu(data_dir):
    torch.manual_seed(0)
    net = common.ConvNet().eval()
    test_set = torch.utils.data.Subset(common.load_dataset("mnist-standin", data_dir, train=False), range(500))
    on_cpu = common.evaluate(net, course.batch_loader(test_set, 100), "cpu")
    dp = nn.DataParallel(net.to("cuda:0"), device_ids=[0, 1], output_device=1)
    on_gpus = common.evaluate(dp, course.batch_loader(test_set, 100), torch.device("cuda:0"))
    assert on_gpus.device == torch.device("cuda:0") and on_gpus[1].item() == 500
    assert abs(on_gpus[0].item() - on_cpu[0].item()) <= 5  # cuDNN (TF32) may flip an argmax or two


def test_gpus_too_old_for_the_build_leave_dataparallel_out_of_the_cpu_run(monkeypatch, data_dir, capsys):
    """A V100 under a build for 7.5 and newer: CUDA is there but unusable. nn.DataParallel would take every
    visible GPU and fail, so the script and the throughput benchmark run the plain model on the CPU."""
    import importlib.util
    import sys

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(common, "too_old_gpus", lambda: ["Tesla V100-SXM2-16GB"])
    spec = importlib.util.spec_from_file_location("mnist_dataparallel", REPO / "01_dataparallel/mnist_dataparallel.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(sys, "argv", ["mnist_dataparallel.py", "--dataset", "mnist-standin", "--data-dir",
                                      str(data_dir), "--epochs", "1", "--max-steps", "3"])
    script.main()
    out = capsys.readouterr().out
    assert "Tesla V100-SXM2-16GB" in out and "final: " in out and "nothing is split" in out
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import throughput

    model = throughput.dataparallel_on(torch.device("cpu"))
    assert not isinstance(model, nn.DataParallel)
    model(torch.randn(2, 1, 28, 28))


def test_dataparallel_refuses_gpus_that_are_not_there():
    gpus = common.usable_gpus()
    if gpus == 0:
        res = python("tools/preflight.py", "01_dataparallel/mnist_dataparallel.py", "--gpus", "0,1", expect_rc=2)
        assert "need CUDA GPUs" in res.stderr
    else:
        res = python("tools/preflight.py", "01_dataparallel/mnist_dataparallel.py", "--gpus", f"0,{gpus}", expect_rc=2)
        assert f"GPU {gpus} does not exist: this machine has {gpus}" in res.stderr
    assert "Traceback" not in res.stderr


def _dataparallel_refusal(monkeypatch, capsys, visible: int, placed: str, **flags) -> str:
    """make's preflight on mnist_dataparallel.py's flags with `visible` usable GPUs (a count the test sets): the
    refusal's one line. The checks are logic over the GPU count, so they run on any machine."""
    import argparse

    from tools import course, preflight

    monkeypatch.setattr(common, "usable_gpus", lambda: visible)
    args = argparse.Namespace(**{"gpus": None, "output_device": None, "device": "auto", **flags})
    with pytest.raises(SystemExit) as stopped:
        preflight.check_gpus(course.ArgumentParser(prog="mnist_dataparallel.py"), args, torch.device(placed))
    assert stopped.value.code == 2
    return capsys.readouterr().err


def test_one_gpu_dataparallel_refuses_another_output_device(monkeypatch, capsys):
    """With one device, DataParallel calls the module and gathers nothing: outputs stay on that GPU."""
    err = _dataparallel_refusal(monkeypatch, capsys, 2, "cuda", gpus=[0], output_device=1)
    assert "--output-device must be that GPU" in err and err.count("\n") == 1


def test_loss_inside_forward_gathers_one_loss_per_gpu_and_mean_weighs_pieces_equally():
    out = python("01_dataparallel/dataparallel_shapes.py", "--gpus", "4", "--loss-inside").stdout
    sizes = [int(v) for v in re.search(r"pieces of \[([\d, ]+)\] samples on 4 GPU", out)[1].split(",")]
    losses = [float(v) for v in re.search(r"gathered losses: \[([-\d., ]+)\] \(shape \[4\]\)", out)[1].split(",")]
    mean, whole = (float(v) for v in re.search(r"loss\.mean\(\) = ([\d.]+); the loss of the whole batch = ([\d.]+)",
                                               out).groups())
    assert sizes == [8, 8, 8, 6] and len(losses) == 4
    assert abs(mean - sum(losses) / 4) < 2e-4  # the plain mean of the gathered vector
    weighted = sum(n * v for n, v in zip(sizes, losses, strict=True)) / sum(sizes)
    assert abs(weighted - whole) < 2e-4 and abs(mean - whole) > 1e-3  # the whole batch weighs by size


def test_loss_inside_with_one_device_is_the_models_own_0_dim_loss():
    """One device: DataParallel calls the model and gathers nothing, so the loss stays 0-dim (without a GPU,
    DataParallel calls the model the same way). The script shows it instead of failing on a 0-dim loss."""
    out = run([PYTHON, "01_dataparallel/dataparallel_shapes.py", "--gpus", "1", "--loss-inside"], env=NO_GPU).stdout
    assert "one device: DataParallel returns the loss as the model does" in out
    assert re.search(r"gathered losses: \[[-\d.]+\] \(shape \[\]\)", out), out
    mean, whole = re.search(r"loss\.mean\(\) = ([\d.]+); the loss of the whole batch = ([\d.]+)$", out, re.M).groups()
    assert mean == whole


@pytest.mark.cuda
def test_loss_inside_on_one_gpu():
    out = python("01_dataparallel/dataparallel_shapes.py", "--gpus", "1", "--loss-inside").stdout
    assert "on 1 GPU(s); one device" in out and "simulated" not in out
    assert re.search(r"gathered losses: \[[-\d.]+\] \(shape \[\]\)", out), out


@pytest.mark.cuda
def test_dataparallel_on_one_gpu_moves_the_model_and_returns_the_output_where_it_is():
    model = nn.Linear(5, 2)  # on the CPU: with one GPU in device_ids, DP moves it there itself
    dp = nn.DataParallel(model, device_ids=[0], output_device=0)
    out = dp(torch.randn(4, 5, device="cuda:0"))
    assert next(model.parameters()).device == torch.device("cuda:0") and out.device == torch.device("cuda:0")


@pytest.mark.multigpu
def test_dataparallel_checks_the_model_device_at_the_first_forward_not_at_the_wrap():
    x = torch.randn(8, 5, device="cuda:0")
    wrapped_first = nn.DataParallel(nn.Linear(5, 2), device_ids=[0, 1])
    wrapped_first.cuda()  # .cuda() after the wrap: fine, as the notes say
    assert wrapped_first(x).shape == (8, 2)
    elsewhere = nn.DataParallel(nn.Linear(5, 2).to("cuda:1"), device_ids=[0, 1])  # the wrap itself accepts it
    with pytest.raises(RuntimeError, match=r"module must have its parameters and buffers on device cuda:0"):
        elsewhere(x)


@pytest.mark.parametrize("flags", [{"gpus": [0, 1]}, {"output_device": 0}], ids=["gpus", "output-device"])
def test_dataparallel_flags_without_a_gpu_are_refused(monkeypatch, capsys, flags):
    err = _dataparallel_refusal(monkeypatch, capsys, 0, "cpu", **flags)
    assert "--gpus and --output-device need CUDA GPUs" in err and err.count("\n") == 1


def test_dataparallel_script_refuses_the_cpu_on_a_gpu_machine(monkeypatch, capsys):
    err = _dataparallel_refusal(monkeypatch, capsys, 1, "cpu", device="cpu")
    assert "for the CPU use mnist_single.py" in err and err.count("\n") == 1


@pytest.mark.parametrize("script", ["mnist_single.py", "mnist_dataparallel.py"])
def test_the_preflight_names_no_backend_for_a_script_without_a_process_group(script, data_dir):
    standin = ["--dataset", "mnist-standin", "--data-dir", data_dir]
    ddp_script = ["--nproc", "2", "03_ddp_torchrun/mnist_torchrun.py", *standin]
    (code, out, _), ddp = exits([("tools/preflight.py", [f"01_dataparallel/{script}", *standin]),
                                 ("tools/preflight.py", ddp_script)], env=NO_GPU)
    assert code == 0 and re.search(r"; this run: 1 process\(es\) per node on cpu$", out, re.M), out
    assert "gloo" not in out and "nccl" not in out
    assert ddp[0] == 0 and "this run: 2 process(es) per node on cpu with gloo" in ddp[1]  # a DDP script: its backend


@pytest.mark.cuda
def test_the_preflight_names_no_backend_for_dataparallel_on_a_gpu(data_dir):
    res = python("tools/preflight.py", "01_dataparallel/mnist_dataparallel.py", "--dataset", "mnist-standin",
                 "--data-dir", str(data_dir))
    assert re.search(r"; this run: 1 process\(es\) per node on cuda$", res.stdout, re.M), res.stdout
    assert "nccl" not in res.stdout
