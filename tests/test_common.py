"""Unit tests of common.py: data stand-ins, device/backend choice, files, ports, CLI checks."""

import argparse
import ast
import pickle
import signal
import socket
import subprocess
import textwrap

import pytest
import torch
import torchvision

import common
from harness import PYTHON, REPO

# ------------------------------------------------------------------ stand-ins through torchvision's own classes


def test_mnist_standin_reads_through_torchvision_mnist(data_dir):
    n_train, n_test = common.STANDIN_SIZES["mnist"]
    for train, n in ((True, n_train), (False, n_test)):
        ds = torchvision.datasets.MNIST(str(data_dir / common.STANDIN_SUBDIR), train=train)
        assert len(ds) == n
        assert ds.data.shape == (n, 28, 28) and ds.data.dtype == torch.uint8
        assert sorted(ds.targets.unique().tolist()) == list(range(10))
        counts = torch.bincount(ds.targets, minlength=10).float()
        assert counts.min() > 0.8 * n / 10, "classes should be roughly balanced"
        image, label = ds[0]  # the class's own __getitem__: a PIL image and an int
        assert image.size == (28, 28) and isinstance(label, int)


def test_cifar_standin_reads_through_torchvision_cifar10(data_dir):
    cls = common.cifar10_standin_class()
    assert issubclass(cls, torchvision.datasets.CIFAR10)
    n_train, n_test = common.STANDIN_SIZES["cifar10"]
    for train, n in ((True, n_train), (False, n_test)):
        ds = cls(str(data_dir / common.STANDIN_SUBDIR), train=train)
        assert len(ds) == n and ds.data.shape == (n, 32, 32, 3)
        assert sorted(set(ds.targets)) == list(range(10))
        assert ds.classes == common.CIFAR_CLASSES
        image, label = ds[0]
        assert image.size == (32, 32) and 0 <= label < 10


def test_standins_are_deterministic_and_seed_dependent():
    a, la = common.make_mnist_standin(64, seed=7)
    b, lb = common.make_mnist_standin(64, seed=7)
    c, _ = common.make_mnist_standin(64, seed=8)
    assert torch.equal(a, b) and torch.equal(la, lb)
    assert not torch.equal(a, c)
    x1, _ = common.make_cifar_standin(32, seed=3)
    x2, _ = common.make_cifar_standin(32, seed=3)
    assert torch.equal(x1, x2)


def test_mnist_standin_is_not_trivial():
    """Same-class images must differ a lot (random warps), or accuracy would mean nothing."""
    images, labels = common.make_mnist_standin(400, seed=1)
    ones = images[labels == 1].float()
    spread = (ones - ones.mean(0)).abs().mean()
    assert spread > 20, f"images of one class are nearly identical (mean abs deviation {spread:.1f})"


def test_load_dataset_gives_normalised_tensors(data_dir):
    train = common.load_dataset("mnist-standin", data_dir, train=True)
    x, y = train.tensors
    assert x.shape == (common.STANDIN_SIZES["mnist"][0], 1, 28, 28) and x.dtype == torch.float32
    assert y.dtype == torch.long
    assert -0.5 < x.mean() < 0.5 and 0.5 < x.std() < 1.5
    test = common.load_dataset("cifar10-standin", data_dir, train=False)
    assert test.tensors[0].shape == (common.STANDIN_SIZES["cifar10"][1], 3, 32, 32)


def test_auto_falls_back_to_standin_loudly(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(common, "try_download", lambda *a, **k: "URLError: no network")
    assert common.prepare_data("auto", tmp_path) == "mnist-standin"
    out = capsys.readouterr().out
    assert "STAND-IN" in out and "no network" in out and "make data" in out
    assert common.resolve_dataset("auto", tmp_path) == "mnist-standin"


def test_auto_prefers_real_data_when_present(tmp_path):
    common.write_mnist_standin(tmp_path, sizes=(20, 10))  # real-format files where real MNIST lives
    assert common.prepare_data("auto", tmp_path) == "mnist"
    assert common.resolve_dataset("auto", tmp_path) == "mnist"


def test_real_dataset_without_data_or_network_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "try_download", lambda *a, **k: "URLError: no network")
    with pytest.raises(common.UsageError, match="make data.*mnist-standin"):
        common.prepare_data("mnist", tmp_path)


# ------------------------------------------------------------------ device and backend


def fake_gpus(monkeypatch, n: int, name: str = "NVIDIA Test GPU"):
    """Make torch report `n` CUDA GPUs (n = 0: CUDA unavailable), for the choice logic only."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (9, 0))


def test_cpu_machine_gets_cpu_and_gloo(monkeypatch):
    fake_gpus(monkeypatch, 0)
    cpu = torch.device("cpu")
    assert common.choose_device("auto", "auto", procs_per_node=2) == (cpu, "gloo")
    assert common.choose_device("cpu", "gloo", procs_per_node=4) == (cpu, "gloo")
    assert common.choose_device("auto", None) == (cpu, None)  # a single-process script
    with pytest.raises(common.UsageError, match="nccl needs CUDA"):
        common.choose_device("auto", "nccl")
    with pytest.raises(common.UsageError, match="no usable CUDA GPU"):
        common.choose_device("cuda", "auto")
    with pytest.raises(common.UsageError, match="at least 1"):
        common.choose_device("auto", "auto", procs_per_node=0)


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_gpu_machines_get_one_gpu_per_nccl_process(monkeypatch, gpus):
    fake_gpus(monkeypatch, gpus)
    for local_rank in range(gpus):  # as many processes as GPUs: CUDA + NCCL, local rank r on cuda:r
        assert common.choose_device("auto", "auto", local_rank=local_rank, procs_per_node=gpus) == \
            (torch.device("cuda", local_rank), "nccl")
    assert common.choose_device("auto", None) == (torch.device("cuda", 0), None)
    # more processes than GPUs: auto falls back to the CPU; asking for NCCL or CUDA is refused in one line
    assert common.choose_device("auto", "auto", procs_per_node=gpus + 1) == (torch.device("cpu"), "gloo")
    for device, backend in (("auto", "nccl"), ("cuda", "auto"), ("cuda", "nccl")):
        with pytest.raises(common.UsageError, match=f"one GPU per process.*NPROC={gpus}.*--backend gloo"):
            common.choose_device(device, backend, procs_per_node=gpus + 1)
    with pytest.raises(common.UsageError, match="CUDA tensors only"):
        common.choose_device("cpu", "nccl")
    assert common.choose_device("cpu", "auto", procs_per_node=gpus) == (torch.device("cpu"), "gloo")


def test_processes_share_gpus_only_with_gloo_and_cuda_asked_for(monkeypatch):
    fake_gpus(monkeypatch, 1)
    placed = [common.choose_device("cuda", "gloo", local_rank=r, procs_per_node=3) for r in range(3)]
    assert placed == [(torch.device("cuda", 0), "gloo")] * 3
    fake_gpus(monkeypatch, 2)
    placed = [common.choose_device("cuda", "gloo", local_rank=r, procs_per_node=4)[0].index for r in range(4)]
    assert placed == [0, 1, 0, 1], "local rank r uses cuda:r % GPUs"


def test_runtime_report_names_the_build_and_says_loudly_when_gpus_go_unused(monkeypatch):
    fake_gpus(monkeypatch, 0)
    monkeypatch.setattr(common.shutil, "which", lambda name: None)
    first = common.runtime_report(torch.device("cpu"), "gloo", 2)
    assert first.startswith(f"torch {torch.__version__} (CUDA {torch.version.cuda}), no CUDA GPU visible; "
                            "this run: 2 process(es) per node on cpu with gloo")
    assert "NOTE" not in first
    monkeypatch.setattr(common.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    assert "NOTE: nvidia-smi is installed but torch sees no usable GPU" in \
        common.runtime_report(torch.device("cpu"), "gloo", 2)

    fake_gpus(monkeypatch, 1, "NVIDIA H100 80GB HBM3")
    report = common.runtime_report(torch.device("cpu"), "gloo", 2)
    assert "1 GPU(s): NVIDIA H100 80GB HBM3" in report
    assert "NOTE: THIS RUN USES THE CPU although 1 GPU(s) are visible" in report and "NPROC=1" in report
    assert "--device cpu was asked for" in common.runtime_report(torch.device("cpu"), "gloo", 1)
    assert "share 1 GPU(s) through Gloo" in common.runtime_report(torch.device("cuda", 0), "gloo", 2)
    assert "NOTE" not in common.runtime_report(torch.device("cuda", 0), "nccl", 1)


def test_gpus_older_than_the_build_are_not_used(monkeypatch):
    """A GPU below the build's lowest compute capability has no kernels: the CPU runs, and a NOTE says why."""
    fake_gpus(monkeypatch, 2, "Tesla P100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (6, 0))
    assert common.gpu_count() == 0
    assert common.choose_device("auto", "auto", procs_per_node=2) == (torch.device("cpu"), "gloo")
    report = common.runtime_report(torch.device("cpu"), "gloo", 2)
    assert "THIS RUN USES THE CPU" in report and "Tesla P100 (6.0)" in report


def _parser(distributed=True):
    parser = argparse.ArgumentParser(prog="x")
    common.add_common_args(parser, distributed=distributed)
    return parser


@pytest.mark.parametrize("argv, message", [
    (["--dataset", "imagenet"], "invalid choice"),
    (["--epochs", "0"], "argument --epochs: expected a whole number of at least 1, got '0'"),
    (["--epochs", "abc"], "argument --epochs: expected a whole number of at least 1, got 'abc'"),
    (["--batch-size", "-3"], "argument --batch-size: expected a whole number of at least 1"),
    (["--max-steps", "-1"], "argument --max-steps: expected 0 (off) or a positive whole number"),
    (["--lr", "nan"], "argument --lr: expected a positive number, got 'nan'"),
    (["--lr", "0"], "argument --lr: expected a positive number"),
    (["--timeout", "inf"], "argument --timeout: expected a positive number, got 'inf'"),
    (["--backend", "nccl"], "nccl needs CUDA"),
])
def test_bad_arguments_end_in_one_clear_line(argv, message, capsys, monkeypatch):
    fake_gpus(monkeypatch, 0)
    parser = _parser()
    with pytest.raises(SystemExit) as exc:
        common.check_args(parser, parser.parse_args(argv))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_data_dir_that_is_a_file_is_refused(tmp_path, capsys):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    parser = _parser()
    with pytest.raises(SystemExit):
        common.check_args(parser, parser.parse_args(["--data-dir", str(not_a_dir)]))
    assert "is not a directory" in capsys.readouterr().err


def test_single_process_parser_has_no_backend_flags():
    args = _parser(distributed=False).parse_args([])
    assert not hasattr(args, "backend") and not hasattr(args, "timeout")
    assert (args.epochs, args.batch_size, args.dataset, args.max_steps) == (2, 64, "auto", 0)


# ------------------------------------------------------------------ files and ports


def test_free_port_is_bindable():
    port = common.free_port()
    assert 1024 <= port <= 65535
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_atomic_save_round_trip(tmp_path):
    path = common.atomic_save({"w": torch.arange(3), "epoch": 2}, tmp_path / "sub" / "ck.pt")
    loaded = torch.load(path, weights_only=True)
    assert loaded["epoch"] == 2 and torch.equal(loaded["w"], torch.arange(3))
    assert [p.name for p in path.parent.iterdir()] == ["ck.pt"], "no temp file may stay behind"


_KILLED_WRITER = textwrap.dedent("""
    import sys, time, torch, common
    path, mode = sys.argv[1], sys.argv[2]
    def slow(f):
        f.write(b"PK" + b"x" * 100000); f.flush()
        print("writing", flush=True); time.sleep(60)
    if mode == "atomic":
        common._atomic_write(path, slow)
    else:
        with open(path, "wb") as f:
            slow(f)
""")


@pytest.mark.parametrize("mode", ["atomic", "plain"])
def test_kill_mid_write(tmp_path, mode):
    """A save killed half-way: the atomic one keeps the previous checkpoint, a plain write destroys it."""
    path = tmp_path / "ck.pt"
    common.atomic_save({"epoch": 1}, path)
    proc = subprocess.Popen([PYTHON, "-c", _KILLED_WRITER, str(path), mode], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    if mode == "atomic":
        assert torch.load(path, weights_only=True) == {"epoch": 1}
    else:
        with pytest.raises(pickle.UnpicklingError):
            torch.load(path, weights_only=True)


def test_rng_state_round_trip_and_weights_only(tmp_path):
    common.seed_everything(5)
    common.atomic_save(common.rng_state(), tmp_path / "rng.pt")
    expected = torch.rand(3)
    torch.rand(10)
    common.set_rng_state(common.load_checkpoint(tmp_path / "rng.pt"))
    assert torch.equal(torch.rand(3), expected)


def test_a_checkpoint_written_on_a_gpu_resumes_on_a_cpu(tmp_path, monkeypatch):
    """A file whose tensors say "cuda:0" (as one saved by a GPU run does) loads and restores here.

    torch.save records each tensor's device; a plain torch.load puts it back there, and a GPU checkpoint
    loaded with map_location=<a GPU> puts the RNG state on the GPU, which torch.set_rng_state refuses.
    load_checkpoint maps everything to the CPU, and set_rng_state moves states to the CPU itself.
    """
    import torch.serialization as ser

    model = common.ConvNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 1, 28, 28)).sum().backward()
    optimizer.step()
    common.seed_everything(3)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": common.rng_state()}
    expected = torch.rand(3)
    registry = list(ser._package_registry)
    monkeypatch.setattr(ser, "_package_registry", [(0, lambda storage: "cuda:0", lambda s, loc: None)] + registry)
    common.atomic_save(state, tmp_path / "gpu.pt")  # every storage tagged as living on cuda:0
    monkeypatch.setattr(ser, "_package_registry", registry)
    with pytest.raises(RuntimeError, match="CUDA"):
        torch.load(tmp_path / "gpu.pt", weights_only=True)  # the naive load wants the GPU back

    loaded = common.load_checkpoint(tmp_path / "gpu.pt")
    fresh = common.ConvNet()
    fresh.load_state_dict(loaded["model"])
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    fresh_optimizer.load_state_dict(loaded["optimizer"])
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters(), strict=True))
    torch.rand(5)
    common.set_rng_state(loaded["rng"])
    assert torch.equal(torch.rand(3), expected)


# ------------------------------------------------------------------ models, loaders, evaluation


def test_models_have_the_expected_shapes():
    assert common.ConvNet()(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in common.ConvNet().modules()) == 2
    assert common.ToyModel()(torch.zeros(4, 10)).shape == (4, 5)
    assert common.ToyMpModel("cpu", "cpu")(torch.zeros(4, 10)).shape == (4, 5)
    resnet = common.resnet18_cifar()
    assert resnet.conv1.stride == (1, 1) and isinstance(resnet.maxpool, torch.nn.Identity)
    assert resnet.eval()(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    assert len(common.RangeDataset(7)) == 7 and common.RangeDataset(7)[3] == 3.0
    assert common.RandomDataset(100, 5)[0].shape == (5,)


def test_batch_loader_fetches_whole_batches_from_any_sampler():
    ds = torch.utils.data.TensorDataset(torch.arange(10).float(), torch.arange(10))
    batches = list(common.batch_loader(ds, 4))
    assert [len(b[1]) for b in batches] == [4, 4, 2]
    assert torch.cat([b[1] for b in batches]).tolist() == list(range(10))
    sampler = [9, 3, 5]
    assert [b[1].tolist() for b in common.batch_loader(ds, 2, sampler=sampler)] == [[9, 3], [5]]
    shuffled = torch.cat([b[1] for b in common.batch_loader(ds, 3, shuffle=True, seed=1)])
    assert sorted(shuffled.tolist()) == list(range(10)) and shuffled.tolist() != list(range(10))


def test_evaluate_returns_sums():
    class Always3(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.one_hot(torch.full((len(x),), 3), 10).float()

    ds = torch.utils.data.TensorDataset(torch.zeros(7, 1), torch.tensor([3, 3, 1, 3, 0, 0, 3]))
    correct, samples, loss_sum = common.evaluate(Always3(), common.batch_loader(ds, 3), "cpu").tolist()
    assert (correct, samples) == (4, 7) and loss_sum > 0


def test_final_line_format():
    line = common.final_line(test_acc=0.98712, test_samples=10000, world_size=2, epochs=2, seconds=12.44,
                             dataset="mnist", restarts=1)
    assert line == ("final: test_acc=0.9871 test_samples=10000 world_size=2 epochs=2 seconds=12.4 "
                    "dataset=mnist restarts=1")


def test_common_makes_no_distributed_call():
    """House rule 1: distribution stays visible in the numbered scripts."""
    tree = ast.parse((REPO / "common.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            assert not any(a.name.startswith("torch.distributed") for a in node.names)
        if isinstance(node, ast.ImportFrom):
            assert not (node.module or "").startswith("torch.distributed")
            assert not (node.module == "torch" and any(a.name == "distributed" for a in node.names))
        if isinstance(node, ast.Attribute):
            assert node.attr != "distributed", f"torch.distributed used at line {node.lineno}"
