"""Unit tests of common.py: data stand-ins, device/backend choice, files, ports, CLI checks."""

import ast
import os
import pickle
import random
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import textwrap

import pytest
import torch

import common
from harness import PYTHON, REPO, run
from tools import course, data, standins, util

# ------------------------------------------------------------------ stand-ins through torchvision's own classes


def torchvision_mnist():
    """torchvision's own MNIST class. Imported here, not at the top: torchvision costs each pytest worker that
    collects this file 2 s."""
    import torchvision

    return torchvision.datasets.MNIST


def torchvision_cifar10_standin():
    """torchvision's CIFAR10 class pointed at the stand-in's files (no md5 check: they are generated)."""
    import torchvision

    class CIFAR10StandIn(torchvision.datasets.CIFAR10):
        base_folder = data.CIFAR_STANDIN_FOLDER
        train_list = [[f"data_batch_{i}", None] for i in range(1, 6)]
        test_list = [["test_batch", None]]
        meta = {"filename": "batches.meta", "key": "label_names", "md5": None}

    return CIFAR10StandIn


def test_mnist_standin_reads_through_torchvision_mnist(standin_dir):
    setup = (REPO / "docs/setup.md").read_text()
    stated = re.search(r"The MNIST stand-in is ([\d,]+)\s+training and ([\d,]+) test", setup)
    n_train, n_test = (int(n.replace(",", "")) for n in stated.groups())  # what docs/setup.md says it is
    for train, n in ((True, n_train), (False, n_test)):
        ds = torchvision_mnist()(str(standin_dir / data.STANDIN_SUBDIR), train=train)
        assert len(ds) == n
        assert ds.data.shape == (n, 28, 28) and ds.data.dtype == torch.uint8
        assert sorted(ds.targets.unique().tolist()) == list(range(10))
        counts = torch.bincount(ds.targets, minlength=10).float()
        assert counts.min() > 0.8 * n / 10, "classes should be roughly balanced"
        image, label = ds[0]  # the class's own __getitem__: a PIL image and an int
        assert image.size == (28, 28) and isinstance(label, int)


def test_cifar_standin_reads_through_torchvision_cifar10(standin_dir):
    cls = torchvision_cifar10_standin()
    n_train, n_test = standins.STANDIN_SIZES["cifar10"]
    for train, n in ((True, n_train), (False, n_test)):
        ds = cls(str(standin_dir / data.STANDIN_SUBDIR), train=train)
        assert len(ds) == n and ds.data.shape == (n, 32, 32, 3)
        assert sorted(set(ds.targets)) == list(range(10))
        assert ds.classes == standins.CIFAR_CLASSES
        image, label = ds[0]
        assert image.size == (32, 32) and 0 <= label < 10


@pytest.mark.parametrize("dataset", ["mnist-standin", "cifar10-standin"])
def test_the_course_reads_the_files_exactly_as_torchvision_does(standin_dir, dataset):
    """common.load_dataset reads the IDX files and pickled batches itself; torchvision's classes must agree."""
    root = str(standin_dir / data.STANDIN_SUBDIR)
    for train in (True, False):
        ours = common.load_dataset(dataset, standin_dir, train=train)
        if dataset == "mnist-standin":
            theirs = torchvision_mnist()(root, train=train)
            pixels = theirs.data.float().div(255).sub(common.MNIST_MEAN).div(common.MNIST_STD).unsqueeze(1)
            labels = theirs.targets
        else:
            theirs = torchvision_cifar10_standin()(root, train=train)
            pixels = torch.from_numpy(theirs.data).permute(0, 3, 1, 2).float().div(255)
            pixels = (pixels - torch.tensor(common.CIFAR_MEAN).view(1, 3, 1, 1)) / \
                torch.tensor(common.CIFAR_STD).view(1, 3, 1, 1)
            labels = torch.tensor(theirs.targets)
        assert torch.equal(ours.tensors[1], labels)
        assert torch.equal(ours.tensors[0], pixels)


def test_the_scripts_read_real_data_and_standins_without_torchvision(tmp_path, monkeypatch):
    """common.load_dataset, which every training script reads its data with, reads the files itself: with
    torchvision not importable, real MNIST and CIFAR-10 files and both stand-ins load all the same."""
    for root in (tmp_path, tmp_path / data.STANDIN_SUBDIR):  # where the real data sets live, and the stand-ins
        standins.write_mnist_standin(root, sizes=(20, 10))
        standins.write_cifar_standin(root, sizes=(20, 10))
    (tmp_path / data.CIFAR_STANDIN_FOLDER).rename(tmp_path / "cifar-10-batches-py")  # real CIFAR-10's folder
    monkeypatch.setitem(sys.modules, "torchvision", None)  # `import torchvision` raises ImportError
    with pytest.raises(ImportError):
        import torchvision  # noqa: F401
    for dataset in ("mnist", "cifar10", "mnist-standin", "cifar10-standin"):
        assert [len(common.load_dataset(dataset, tmp_path, train=train)) for train in (True, False)] == [20, 10]


def test_standins_are_deterministic_and_seed_dependent():
    a, la = standins.make_mnist_standin(64, seed=7)
    b, lb = standins.make_mnist_standin(64, seed=7)
    c, _ = standins.make_mnist_standin(64, seed=8)
    assert torch.equal(a, b) and torch.equal(la, lb)
    assert not torch.equal(a, c)
    x1, _ = standins.make_cifar_standin(32, seed=3)
    x2, _ = standins.make_cifar_standin(32, seed=3)
    assert torch.equal(x1, x2)


def test_mnist_standin_is_not_trivial():
    """Same-class images must differ a lot (random warps), or accuracy would mean nothing."""
    images, labels = standins.make_mnist_standin(400, seed=1)
    ones = images[labels == 1].float()
    spread = (ones - ones.mean(0)).abs().mean()
    assert spread > 20, f"images of one class are nearly identical (mean abs deviation {spread:.1f})"


def test_load_dataset_gives_normalised_tensors(standin_dir):
    train = common.load_dataset("mnist-standin", standin_dir, train=True)
    x, y = train.tensors
    assert x.shape == (standins.STANDIN_SIZES["mnist"][0], 1, 28, 28) and x.dtype == torch.float32
    assert y.dtype == torch.long
    assert -0.5 < x.mean() < 0.5 and 0.5 < x.std() < 1.5
    test = common.load_dataset("cifar10-standin", standin_dir, train=False)
    assert test.tensors[0].shape == (standins.STANDIN_SIZES["cifar10"][1], 3, 32, 32)


def test_auto_falls_back_to_standin_loudly(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(data, "try_download", lambda *a, **k: "URLError: no network")
    assert common.prepare_data("auto", tmp_path) == "mnist-standin"
    out = capsys.readouterr().out
    assert "STAND-IN" in out and "no network" in out and "make data" in out
    assert data.resolve_dataset("auto", tmp_path) == "mnist-standin"


def test_auto_prefers_real_data_when_present(tmp_path):
    standins.write_mnist_standin(tmp_path, sizes=(20, 10))  # real-format files where real MNIST lives
    assert common.prepare_data("auto", tmp_path) == "mnist"
    assert data.resolve_dataset("auto", tmp_path) == "mnist"


def test_real_dataset_without_data_or_network_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "try_download", lambda *a, **k: "URLError: no network")
    with pytest.raises(course.UsageError, match="make data.*mnist-standin"):
        common.prepare_data("mnist", tmp_path)


def copied_project(monkeypatch):
    """common.py copied into a project of its own: no tools/ package to import. Returns the torchvision classes
    prepare_data constructs there, as (class name, root, train, download) calls, downloading nothing."""
    import torchvision

    monkeypatch.setitem(sys.modules, "tools", None)  # `from tools import data` raises ModuleNotFoundError
    calls = []
    for name in ("MNIST", "CIFAR10"):
        monkeypatch.setattr(torchvision.datasets, name, lambda root, train, download, name=name:
                            calls.append((name, root, train, download)))
    return calls


@pytest.mark.parametrize("dataset, family", [("mnist-standin", "mnist"), ("cifar10-standin", "cifar10")])
def test_a_copied_common_uses_a_standin_on_disk_and_downloads_nothing(tmp_path, monkeypatch, dataset, family):
    (standins.write_mnist_standin if family == "mnist" else standins.write_cifar_standin)(
        tmp_path / data.STANDIN_SUBDIR, sizes=(20, 10))
    calls = copied_project(monkeypatch)
    assert common.prepare_data(dataset, tmp_path, family) == dataset
    assert common.prepare_data(dataset, tmp_path, family, download=False) == dataset
    assert calls == []  # not CIFAR-10's download, whatever the stand-in
    assert len(common.load_dataset(dataset, tmp_path, train=False)) == 10


def test_a_copied_common_without_the_standin_says_where_it_comes_from(tmp_path, monkeypatch):
    calls = copied_project(monkeypatch)
    for dataset, real in (("mnist-standin", "mnist"), ("cifar10-standin", "cifar10")):
        with pytest.raises(RuntimeError, match=re.escape(f"--dataset {dataset}: not in {tmp_path / 'standin'}. The "
                                                         f"stand-in is written by the course's tools/; copy its files "
                                                         f"or use --dataset {real}")):
            common.prepare_data(dataset, tmp_path, real)
    assert calls == []


def test_a_copied_common_downloads_each_real_dataset_with_its_own_class(tmp_path, monkeypatch):
    calls = copied_project(monkeypatch)
    assert common.prepare_data("mnist", tmp_path) == "mnist"
    assert common.prepare_data("auto", tmp_path, "cifar10") == "cifar10"
    assert common.prepare_data("cifar10", tmp_path, "cifar10", download=False) == "cifar10"
    root = str(tmp_path)
    assert calls == [("MNIST", root, True, True), ("MNIST", root, False, True),
                     ("CIFAR10", root, True, True), ("CIFAR10", root, False, True)]
    assert (tmp_path / ".download.lock").exists()  # the machines sharing the folder took turns on it


def test_the_course_downloads_real_data_through_torchvision_alone(tmp_path, monkeypatch):
    """tools/data.py, which common.prepare_data asks in the course: MNIST and CIFAR-10 come from torchvision's own
    classes, train and test split, into the data folder."""
    import torchvision

    calls = []
    for name in ("MNIST", "CIFAR10"):
        monkeypatch.setattr(torchvision.datasets, name, lambda root, train, download, name=name:
                            calls.append((name, root, train, download)))
    assert data.try_download("mnist", tmp_path) is None and data.try_download("cifar10", tmp_path) is None
    root = str(tmp_path)
    assert calls == [("MNIST", root, True, True), ("MNIST", root, False, True),
                     ("CIFAR10", root, True, True), ("CIFAR10", root, False, True)]


PREPARE_AT = """
import sys, time
from tools import data
start = float(sys.argv[2])
time.sleep(max(0.0, start - time.time()))  # both start at once, whatever their imports cost
print("prepared", data.prepare("mnist-standin", sys.argv[1]), flush=True)
"""


@pytest.mark.slow
def test_two_machines_preparing_one_shared_folder_take_turns(tmp_path):
    """Two nodes' local rank 0 write the stand-in into one shared data folder at the same moment: the lock makes
    the second wait, then find it complete. Exactly one writes, and the files are those of a run alone."""
    import time

    shared, alone = tmp_path / "shared", tmp_path / "alone"
    start = time.time() + 8
    procs = [subprocess.Popen([PYTHON, "-c", PREPARE_AT, str(shared), str(start)], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for _ in range(2)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all("prepared mnist-standin" in out for out in outs), outs
    assert sum("generated the mnist-standin" in out for out in outs) == 1, outs  # the other found it written
    data.prepare("mnist-standin", alone, quiet=True)
    files = sorted(p.relative_to(alone) for p in (alone / data.STANDIN_SUBDIR).rglob("*") if p.is_file())
    assert files and files == sorted(p.relative_to(shared) for p in (shared / data.STANDIN_SUBDIR).rglob("*")
                                     if p.is_file())
    for name in files:
        assert (shared / name).read_bytes() == (alone / name).read_bytes(), name


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
    assert common.device_and_backend("auto", "auto", procs_per_node=2) == (cpu, "gloo")
    assert common.device_and_backend("cpu", "gloo", procs_per_node=4) == (cpu, "gloo")
    with pytest.raises(RuntimeError, match="^--backend nccl needs CUDA GPUs and none is usable here"):
        common.device_and_backend("auto", "nccl")
    with pytest.raises(RuntimeError, match="^--device cuda: no usable CUDA GPU"):
        common.device_and_backend("cuda", "auto")


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_gpu_machines_get_one_gpu_per_nccl_process(monkeypatch, gpus):
    fake_gpus(monkeypatch, gpus)
    for local_rank in range(gpus):  # as many processes as GPUs: CUDA + NCCL, local rank r on cuda:r
        assert common.device_and_backend("auto", "auto", local_rank=local_rank, procs_per_node=gpus) == \
            (torch.device("cuda", local_rank), "nccl")
    # more processes than GPUs: auto falls back to the CPU (and says so); asking for NCCL or CUDA is refused
    assert common.device_and_backend("auto", "auto", procs_per_node=gpus + 1) == (torch.device("cpu"), "gloo")
    for device, backend in (("auto", "nccl"), ("cuda", "auto"), ("cuda", "nccl")):
        with pytest.raises(RuntimeError, match=f"^NCCL needs one GPU per process: {gpus + 1} processes on this "
                                               f"machine, {gpus} usable GPU.*NPROC={gpus}.*--backend gloo"):
            common.device_and_backend(device, backend, procs_per_node=gpus + 1)
    with pytest.raises(RuntimeError, match="CUDA tensors only"):
        common.device_and_backend("cpu", "nccl")
    assert common.device_and_backend("cpu", "auto", procs_per_node=gpus) == (torch.device("cpu"), "gloo")


def test_processes_share_gpus_only_with_gloo_and_cuda_asked_for(monkeypatch):
    fake_gpus(monkeypatch, 1)
    placed = [common.device_and_backend("cuda", "gloo", local_rank=r, procs_per_node=3) for r in range(3)]
    assert placed == [(torch.device("cuda", 0), "gloo")] * 3
    fake_gpus(monkeypatch, 2)
    placed = [common.device_and_backend("cuda", "gloo", local_rank=r, procs_per_node=4)[0].index for r in range(4)]
    assert placed == [0, 1, 0, 1], "local rank r uses cuda:r % GPUs"


def test_a_run_that_leaves_gpus_unused_says_so_once_per_machine(monkeypatch, capsys):
    fake_gpus(monkeypatch, 1, "NVIDIA H100 80GB HBM3")
    assert common.device_and_backend("auto", "auto", local_rank=0, procs_per_node=2)[0].type == "cpu"
    assert "NOTE: THIS RUN USES THE CPU although CUDA GPUs are visible (2 processes on this machine, 1 GPU(s)" \
        in capsys.readouterr().out
    common.device_and_backend("auto", "auto", local_rank=1, procs_per_node=2)  # local rank 1: quiet
    common.device_and_backend("cuda", "nccl", local_rank=0, procs_per_node=1)  # the GPU used: nothing to say
    assert capsys.readouterr().out == ""


def test_runtime_report_names_the_build_and_the_gpus(monkeypatch):
    fake_gpus(monkeypatch, 0)
    monkeypatch.setattr(course.shutil, "which", lambda name: None)
    first = course.runtime_report(torch.device("cpu"), "gloo", 2)
    assert first.startswith(f"torch {torch.__version__} (CUDA {torch.version.cuda}), no CUDA GPU visible; "
                            "this run: 2 process(es) per node on cpu with gloo")
    assert "NOTE" not in first
    monkeypatch.setattr(course.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    assert "NOTE: nvidia-smi is installed but torch sees no usable GPU" in \
        course.runtime_report(torch.device("cpu"), "gloo", 2)
    fake_gpus(monkeypatch, 1, "NVIDIA H100 80GB HBM3")
    assert "1 GPU(s): NVIDIA H100 80GB HBM3" in course.runtime_report(torch.device("cpu"), "gloo", 2)
    assert "share 1 GPU(s) through Gloo" in course.runtime_report(torch.device("cuda", 0), "gloo", 2)
    assert "NOTE" not in course.runtime_report(torch.device("cuda", 0), "nccl", 1)


def test_gpus_older_than_the_build_are_not_used(monkeypatch, capsys):
    """A GPU below the build's lowest compute capability has no kernels: the CPU runs, and a NOTE says why."""
    fake_gpus(monkeypatch, 2, "Tesla P100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (6, 0))
    assert common.usable_gpus() == 0
    assert common.device_and_backend("auto", "auto", procs_per_node=2) == (torch.device("cpu"), "gloo")
    assert "older than this torch build supports: Tesla P100, Tesla P100" in capsys.readouterr().out
    # read while a GPU is pretended: some releases (2.11) list the build's architectures only where CUDA is available
    archs = [int(a[3:]) for a in torch.cuda.get_arch_list() if a.startswith("sm_")]
    monkeypatch.undo()
    if torch.version.cuda == "13.0":  # the CUDA 13 builds (docs/setup.md): kernels from compute capability 7.5 on
        assert min(archs) == 75 and 70 not in archs, archs


def _parser():
    """A training script's flags (common.add_training_flags), with the one-line errors make's preflight gives."""
    return common.add_training_flags(course.ArgumentParser(prog="x"))


@pytest.mark.parametrize("argv, message", [
    (["--dataset", "imagenet"], "invalid choice"),
    (["--epochs", "0"], "--epochs must be at least 1, got 0"),
    (["--epochs", "abc"], "argument --epochs/--num_epochs/-e: invalid int value: 'abc'"),
    (["--batch-size", "-3"], "--batch-size must be at least 1, got -3"),
    (["--max-steps", "-1"], "--max-steps must be at least 0, got -1"),
    (["--lr", "nan"], "--lr must be a positive number, got nan"),
    (["--lr", "0"], "--lr must be a positive number, got 0.0"),
    (["--timeout", "inf"], "--timeout must be a positive number, got inf"),
    (["--backend", "nccl"], "--backend nccl needs CUDA GPUs"),
    (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
], ids=["dataset", "epochs-0", "epochs-abc", "batch-size-negative", "max-steps-negative", "lr-nan", "lr-0",
        "timeout-inf", "nccl-without-gpu", "batch-size-0"])
def test_bad_arguments_end_in_one_clear_line(argv, message, capsys, monkeypatch):
    """What make's preflight checks before a launch: the numbers, then the folders and the device."""
    from tools import preflight

    fake_gpus(monkeypatch, 0)
    parser = _parser()
    with pytest.raises(SystemExit) as exc:
        args = parser.parse_args(argv)
        preflight.check_numbers(parser, args)
        course.check_args(parser, args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, "one line, not argparse's usage block"


def test_data_dir_that_is_a_file_is_refused(tmp_path, capsys):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    parser = _parser()
    with pytest.raises(SystemExit):
        course.check_args(parser, parser.parse_args(["--data-dir", str(not_a_dir)]))
    assert "is not a directory" in capsys.readouterr().err


# ------------------------------------------------------------------ files and ports


def test_free_port_is_bindable():
    port = common.free_port()
    assert 1024 <= port <= 65535
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_free_port_lies_below_the_range_the_os_gives_to_new_connections_never_repeats_and_ignores_the_seed():
    """02's pitfall: a port from a bind to port 0 can go to any outgoing connection before rank 0 listens on it."""
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    ports = []
    for _ in range(20):
        random.seed(0)  # as common.seed_everything does in the parent: two jobs must still get different ports
        ports.append(common.free_port())
    assert all(10000 <= p < low for p in ports) and len(set(ports)) == len(ports), (low, ports)
    more = [common.free_port() for _ in range(300)]  # jobs started side by side never share one (the error gallery)
    assert len(set(more + ports)) == len(more + ports)


def test_atomic_save_round_trip(tmp_path):
    path = util._atomic_write(tmp_path / "sub" / "ck.pt", lambda f: torch.save({"w": torch.arange(3), "epoch": 2}, f))
    loaded = torch.load(path, weights_only=True)
    assert loaded["epoch"] == 2 and torch.equal(loaded["w"], torch.arange(3))
    assert [p.name for p in path.parent.iterdir()] == ["ck.pt"], "no temp file may stay behind"


_KILLED_WRITER = textwrap.dedent("""
    import sys, time, torch
    from tools import util
    path, mode = sys.argv[1], sys.argv[2]
    def slow(f):
        f.write(b"PK" + b"x" * 100000); f.flush()
        print("writing", flush=True); time.sleep(60)
    if mode == "atomic":
        util._atomic_write(path, slow)
    else:
        with open(path, "wb") as f:
            slow(f)
""")


@pytest.mark.parametrize("mode", ["atomic", "plain"])
def test_kill_mid_write(tmp_path, mode):
    """A save killed half-way: the atomic one keeps the previous checkpoint, a plain write destroys it."""
    path = tmp_path / "ck.pt"
    torch.save({"epoch": 1}, path)
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


def test_a_checkpoint_written_on_a_gpu_resumes_on_a_cpu(tmp_path, monkeypatch):
    """A file whose tensors say "cuda:0" (as one saved by a GPU run does) loads and restores here, loaded as the
    scripts load it: torch.load(path, map_location=<this rank's device>, weights_only=True). A plain torch.load puts
    every tensor back where it was saved, which fails where there is no CUDA."""
    import torch.serialization as ser

    model = common.ConvNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 1, 28, 28)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 1}
    registry = list(ser._package_registry)
    monkeypatch.setattr(ser, "_package_registry", [(0, lambda storage: "cuda:0", lambda s, loc: None)] + registry)
    torch.save(state, tmp_path / "gpu.pt")  # every storage tagged as living on cuda:0
    monkeypatch.setattr(ser, "_package_registry", registry)
    if not torch.cuda.is_available():  # where CUDA is there, the naive load puts the tensors back on cuda:0
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(tmp_path / "gpu.pt", weights_only=True)  # the naive load wants the GPU back
    loaded = torch.load(tmp_path / "gpu.pt", map_location=torch.device("cpu"), weights_only=True)
    fresh = common.ConvNet()
    fresh.load_state_dict(loaded["model"])
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    fresh_optimizer.load_state_dict(loaded["optimizer"])
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters(), strict=True))
    assert "map_location=device, weights_only=True" in (REPO / "03_ddp_torchrun/mnist_torchrun.py").read_text()


# ------------------------------------------------------------------ models, loaders, evaluation


def test_models_have_the_expected_shapes():
    assert common.ConvNet()(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in common.ConvNet().modules()) == 2
    assert common.ToyModel()(torch.zeros(4, 10)).shape == (4, 5)
    resnet = common.resnet18_cifar()
    assert resnet.conv1.stride == (1, 1) and isinstance(resnet.maxpool, torch.nn.Identity)
    assert resnet.eval()(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


def test_batch_loader_fetches_whole_batches_from_any_sampler():
    ds = torch.utils.data.TensorDataset(torch.arange(10).float(), torch.arange(10))
    batches = list(course.batch_loader(ds, 4))
    assert [len(b[1]) for b in batches] == [4, 4, 2]
    assert torch.cat([b[1] for b in batches]).tolist() == list(range(10))
    sampler = [9, 3, 5]
    assert [b[1].tolist() for b in course.batch_loader(ds, 2, sampler=sampler)] == [[9, 3], [5]]
    shuffled = torch.cat([b[1] for b in course.batch_loader(ds, 3, shuffle=True, seed=1)])
    assert sorted(shuffled.tolist()) == list(range(10)) and shuffled.tolist() != list(range(10))


def test_evaluate_returns_sums():
    class Always3(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.one_hot(torch.full((len(x),), 3), 10).float()

    ds = torch.utils.data.TensorDataset(torch.zeros(7, 1), torch.tensor([3, 3, 1, 3, 0, 0, 3]))
    correct, samples, loss_sum = common.evaluate(Always3(), course.batch_loader(ds, 3), "cpu").tolist()
    assert (correct, samples) == (4, 7) and loss_sum > 0


def test_evaluate_builds_no_graph():
    seen = []
    model = torch.nn.Linear(1, 10)
    model.register_forward_hook(lambda module, args, out: seen.append(out.requires_grad))
    ds = torch.utils.data.TensorDataset(torch.zeros(4, 1), torch.tensor([3, 3, 1, 3]))
    totals = common.evaluate(model, course.batch_loader(ds, 2), "cpu")
    assert seen == [False, False] and not totals.requires_grad, "evaluation must run under torch.no_grad()"
    assert model.training, "evaluate puts the model back in training mode"


def test_final_line_format_and_parsing():
    line = ("final: test_acc=0.9871 test_samples=10000 world_size=2 epochs=2 seconds=12.4 dataset=mnist "
            "weights=0001e100 ranks_agree=True restarts=1")  # as the training scripts print it
    for script in ("01_dataparallel/mnist_single.py", "01_dataparallel/mnist_dataparallel.py",
                   "02_ddp_spawn/mnist_spawn.py", "03_ddp_torchrun/mnist_torchrun.py", "04_multinode_tcp/mnist_tcp.py",
                   "06_amp_syncbn/mnist_amp_syncbn.py", "06_amp_syncbn/cifar_resnet.py"):
        source = (REPO / script).read_text()  # one summary, its first fields in this order
        assert len(re.findall(r'print\(f"final: ', source)) == 1, script
        assert "= common.device_and_backend(args.device" in source, script  # each chooses by itself (docs/setup.md)
        if "init_process_group(" in source:  # and a DDP script binds its process to its GPU
            assert "torch.cuda.set_device(device)" in source and 'device_id=device if backend == "nccl"' in source
        fields = r'print\(f"final: test_acc=\{[^}]+\} test_samples=\{[^}]+\} world_size=\{[^}]+\} '
        assert re.search(fields, source), script
    parsed = course.parse_lines("noise\n" + line + "\nfinal: test_acc=0.5000", "final")
    assert parsed[0] == {"test_acc": 0.9871, "test_samples": 10000, "world_size": 2, "epochs": 2, "seconds": 12.4,
                         "dataset": "mnist", "weights": "0001e100", "ranks_agree": "True", "restarts": 1}
    assert parsed[1] == {"test_acc": 0.5}


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


# ------------------------------------------------------------------ checkpoints: damaged or unwritable, never lost

@pytest.mark.parametrize("damage", ["random", "truncated"])
def test_a_damaged_checkpoint_is_named_in_one_line_and_left_as_it_is(tmp_path, damage):
    """make's preflight, before a launch, on a checkpoint the script would continue from: one line, file untouched."""
    path = tmp_path / "mnist_torchrun.pt"
    if damage == "random":
        path.write_bytes(os.urandom(5000))
    else:
        torch.save({"epoch": 1, "model": common.ConvNet().state_dict()}, path)
        path.write_bytes(path.read_bytes()[:3000])
    before = path.read_bytes()
    res = run([PYTHON, REPO / "tools/preflight.py", "--nproc", "2", REPO / "03_ddp_torchrun/mnist_torchrun.py",
               "--checkpoint-dir", tmp_path], expect_rc=2)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and "is damaged or not a checkpoint" in lines[0], res.tail()
    assert "weights_only" not in res.stderr and path.read_bytes() == before


def test_an_unwritable_checkpoint_dir_is_refused_before_training(capsys):
    parser = _parser()
    with pytest.raises(SystemExit):
        course.check_args(parser, parser.parse_args(["--checkpoint-dir", "/proc/no/such/folder"]))
    assert "--checkpoint-dir /proc/no/such/folder cannot be created" in capsys.readouterr().err


def test_files_get_the_mode_the_umask_gives(tmp_path):
    old = os.umask(0o022)
    try:
        path = util.atomic_write_bytes(b"x", tmp_path / "ck.pt")
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, "mkstemp's 0600 would hide it from other users"
    finally:
        os.umask(old)


# ------------------------------------------------------------------ data: damaged stand-ins, missing real files


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_a_damaged_standin_is_written_again(tmp_path, damage, capsys, standin_dir):
    shutil.copytree(standin_dir, tmp_path, dirs_exist_ok=True)  # a complete stand-in, as data.prepare wrote it
    victim = tmp_path / data.STANDIN_SUBDIR / "MNIST" / "raw" / "t10k-images-idx3-ubyte"
    good = victim.read_bytes()
    if damage == "deleted":
        victim.unlink()
    else:
        victim.write_bytes(good[:1000])
    capsys.readouterr()
    assert common.prepare_data("mnist-standin", tmp_path) == "mnist-standin"
    out = capsys.readouterr().out
    assert "the old one was damaged" in out and victim.name in out
    assert victim.read_bytes() == good, "the stand-in is deterministic: the same bytes again"


def test_a_missing_real_file_is_named(tmp_path, monkeypatch):
    standins.write_mnist_standin(tmp_path, sizes=(20, 10))  # real-format files where real MNIST lives
    (tmp_path / "MNIST" / "raw" / "t10k-labels-idx1-ubyte").unlink()
    monkeypatch.setattr(data, "try_download", lambda *a, **k: "URLError: no network")
    with pytest.raises(course.UsageError, match="t10k-labels-idx1-ubyte is missing .*make data"):
        common.prepare_data("mnist", tmp_path)


def test_a_data_dir_that_cannot_be_created_is_one_line(tmp_path):
    with pytest.raises(course.UsageError, match="--data-dir /proc/x cannot be created"):
        common.prepare_data("mnist-standin", "/proc/x")


def test_auto_remembers_a_failed_download_for_an_hour(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(data, "try_download", lambda *a, **k: calls.append(1) or "URLError: no network")
    assert data.prepare("auto", tmp_path, quiet=True) == "mnist-standin"
    assert data.prepare("auto", tmp_path, quiet=True) == "mnist-standin"
    assert len(calls) == 1, "the second run does not wait for the network again"


# ------------------------------------------------------------------ small facts the READMEs state


def test_each_cpu_process_gets_its_share_of_the_cores_unless_omp_num_threads_is_set(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        cores = len(os.sched_getaffinity(0))
        assert course.share_cpu_threads(2) == max(1, cores // 2) == torch.get_num_threads()
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        mine = max(1, cores // 2) + 1  # a count share_cpu_threads would never choose
        torch.set_num_threads(mine)
        assert course.share_cpu_threads(2) == mine == torch.get_num_threads()  # the user's setting wins
    finally:
        torch.set_num_threads(before)


def test_the_default_collective_timeout_is_a_minute():
    assert _parser().parse_args([]).timeout == 60.0


def test_rng_state_must_be_a_cpu_byte_tensor():
    with pytest.raises(TypeError, match="RNG state must be a torch.ByteTensor"):
        torch.set_rng_state(torch.zeros(8))


def test_the_installed_wheel_has_no_mpi_backend():
    import torch.distributed as dist

    assert dist.is_gloo_available() and not dist.is_mpi_available()
    assert dist.is_nccl_available() == (torch.version.cuda is not None)  # the CUDA build has NCCL, the CPU build not


def test_a_gradscaler_without_a_device_warns_on_a_machine_without_cuda():
    code = ("import warnings, torch\nwith warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always'); torch.amp.GradScaler()\nprint([str(x.message) for x in w])")
    out = subprocess.run([PYTHON, "-c", code], env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
                         capture_output=True, text=True, timeout=120).stdout
    assert "CUDA is not available" in out, out


@pytest.mark.parametrize("rank, local_rank, speaks", [("0", "0", True), ("2", "0", True), ("3", "1", False)])
def test_a_mistake_is_said_by_local_rank_0_of_each_node_only(monkeypatch, capsys, rank, local_rank, speaks):
    """Node 1's data or checkpoint folder can fail where rank 0's does not: its local rank 0 says so."""
    for name, value in (("RANK", rank), ("LOCAL_RANK", local_rank), ("WORLD_SIZE", "4")):
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as ended:
        course.ArgumentParser(prog="x").error("--data-dir /x is not writable")
    assert ended.value.code == 2
    assert ("error: --data-dir /x is not writable" in capsys.readouterr().err) is speaks


def test_training_flags_accept_the_notes_spellings():
    """common.add_training_flags: the source notes' spellings are aliases of the course's flags."""
    import argparse

    parser = common.add_training_flags(argparse.ArgumentParser())
    notes = parser.parse_args(["-e", "3", "-b", "16", "--num_epochs", "4", "--learning_rate", "0.5",
                               "--random_seed", "7", "--model_dir", "ck", "--batch_size", "8"])
    assert (notes.epochs, notes.batch_size, notes.lr, notes.seed, notes.checkpoint_dir) == (4, 8, 0.5, 7, "ck")
    shared = {action.option_strings[0] for action in parser._actions if action.dest != "help"}  # docs/setup.md
    assert shared == {"--epochs", "--batch-size", "--lr", "--dataset", "--data-dir", "--seed", "--max-steps",
                      "--log-every", "--checkpoint-dir", "--device", "--backend", "--timeout"}
