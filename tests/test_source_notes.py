"""The source notes' own command lines, with the course's scripts: each one runs, or fails in one line that names
the course's way. Runs are checks only (make's preflight: the flags are parsed and checked, the data prepared,
and nothing is launched; a script that needs no preflight only parses its flags here), all in one interpreter,
so that every command costs well under a second.

Also the notes' hyperparameters next to the course's: the numbers that the rows of docs/source-notes.md's tables
(where the course departs from the notes) give for the course are the scripts' defaults and the constants in their
code (read without training, from the parser each script builds)."""

import argparse
import inspect
import re
import runpy
import shlex
from functools import cache
from pathlib import Path
from unittest import mock

import pytest

import common
from harness import REPO, exits

# what torchrun (or the deprecated launcher) gives every worker; rank 0 speaks for the job
LAUNCHED = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}

NOTES_COMMANDS = [  # (where in the notes, the command with the course's script, launched?, None = runs / the error)
    ("Kai Zhang's tutorial, one GPU", "01_dataparallel/mnist_single.py -g 0 -e 1 -b 64", False,
     "CUDA_VISIBLE_DEVICES=N in front of the command"),
    ("Kai Zhang's tutorial, one GPU, without -g", "01_dataparallel/mnist_single.py -e 1 -b 64", False, None),
    ("Kai Zhang's tutorial, TCP mode", "04_multinode_tcp/mnist_tcp.py --init_method tcp://127.0.0.1:29999 -g 0 "
     "--rank 0 --world_size 4 --use_mix_precision", False, "mixed precision is step 6"),
    ("Kai Zhang's tutorial, TCP mode, step 4's way", "04_multinode_tcp/mnist_tcp.py --init_method "
     "tcp://127.0.0.1:29999 -g 0 --rank 0 --world_size 4", False, None),
    ("Kai Zhang's tutorial, ENV mode", "06_amp_syncbn/mnist_amp_syncbn.py --local_rank=0 --use_mix_precision", True,
     None),
    ("the blog, resnet_ddp.py", "06_amp_syncbn/cifar_resnet.py --local_rank=0 --num_epochs 2 --batch_size 32 "
     "--learning_rate 0.1 --random_seed 0 --model_dir saved_models", True, None),
    ("the blog, resnet_ddp.py, --resume", "06_amp_syncbn/cifar_resnet.py --local_rank=0 --resume", True,
     "continues the checkpoint in --checkpoint-dir by itself"),
    ("the blog, resnet_ddp.py, with the course's flags", "06_amp_syncbn/cifar_resnet.py --local_rank=0 --epochs 2 "
     "--batch_size 32 --lr 0.1 --seed 0 --use_mix_precision", True, None),
    ("Kai Zhang's --use_mix_precision on the spawn step", "02_ddp_spawn/mnist_spawn.py --use_mix_precision", False,
     "mixed precision is step 6"),
    ("Kai Zhang's --use_mix_precision on the torchrun step", "03_ddp_torchrun/mnist_torchrun.py --local_rank=0 "
     "--use_mix_precision", True, "mixed precision is step 6"),
    ("the blog and the launch cheat-sheet, example.py", "03_ddp_torchrun/mnist_torchrun.py --local_world_size=2",
     True, "one process per GPU"),
    ("the DataParallel and DDP notes, torchrun ... --local_rank=0,1", "03_ddp_torchrun/mnist_torchrun.py "
     "--local_rank=0,1", True, "torchrun gives every process its own LOCAL_RANK"),
    ("the launch cheat-sheet, demo.py", "04_multinode_tcp/spawn_per_node.py --world_size=3 --node_rank=0 "
     "--master_addr=127.0.0.1 --master_port=29999 --nproc_per_node=2", False, "add up to 2"),
]


PLAIN = ("mnist_single", "mnist_spawn", "mnist_torchrun", "mnist_tcp", "mnist_amp_syncbn", "cifar_resnet")


def call(command: str, launched: bool, data_dir: Path, tmp: Path) -> tuple:
    """The scripts in plain PyTorch (the chain, cifar_resnet.py) are checked by make's preflight; the launch script
    spawn_per_node.py checks its own flags (the one command here ends there, before anything starts)."""
    script, *argv = shlex.split(command)
    argv = [str(tmp / arg) if arg == "saved_models" else arg for arg in argv]  # the blog's folder, not in the repo
    if "spawn_per_node" not in command:
        argv += ["--data-dir", str(data_dir)]
    if Path(script).stem in PLAIN:
        return "tools/preflight.py", [script, *argv], {}
    return script, argv, LAUNCHED if launched else {}


@pytest.mark.slow
def test_the_notes_commands_run_or_name_the_course_way(data_dir, tmp_path):
    results = exits([call(c[1], c[2], data_dir, tmp_path) for c in NOTES_COMMANDS])
    for (where, command, _, error), (code, out, err) in zip(NOTES_COMMANDS, results, strict=True):
        lines = [ln for ln in err.strip().splitlines() if not ln.startswith("NOTE:")]
        if error is None:
            assert code in (0, None), (where, command, code, out[-500:], err[-500:])
        else:
            assert code == 2, (where, command, code, err[-500:])
            assert len(lines) == 1 and error in lines[0], (where, lines)
            assert re.match(r"\S+\.py: error: ", lines[0]), lines
    by_place = dict(zip([c[0] for c in NOTES_COMMANDS], results, strict=True))
    two_nodes = by_place["Kai Zhang's tutorial, TCP mode, step 4's way"]  # two machines: the plan is said
    assert "--rank without --nproc-per-node" in two_nodes[1] and "add --nproc-per-node N" in two_nodes[1]


@pytest.mark.parametrize("script", ["06_amp_syncbn/mnist_amp_syncbn.py", "06_amp_syncbn/cifar_resnet.py"])
def test_use_mix_precision_means_fp16_in_both_step_6_scripts(script):
    """Kai Zhang's --use_mix_precision switches on torch.cuda.amp.autocast (float16) and a GradScaler: --amp fp16."""
    parser = parser_of(script)
    assert parser.parse_args(["--use_mix_precision"]).amp == "fp16"
    assert parser.parse_args(["--amp", "fp16"]).amp == "fp16"
    assert parser.parse_args([]).amp != "fp16", "without the flag the default is not fp16"


# ------------------------------------------------------------------ the notes' hyperparameters and the course's

MNIST_SCRIPTS = ("01_dataparallel/mnist_single.py", "01_dataparallel/mnist_dataparallel.py",
                 "02_ddp_spawn/mnist_spawn.py", "03_ddp_torchrun/mnist_torchrun.py", "04_multinode_tcp/mnist_tcp.py",
                 "06_amp_syncbn/mnist_amp_syncbn.py")
CIFAR_SCRIPTS = ("06_amp_syncbn/cifar_resnet.py",)
HYPERPARAMETER_ROWS = {  # id: (README, how its row begins, the scripts the row's last cell is about, what it states)
    "01-kai-batch": ("01_dataparallel/README.md", "Kai Zhang's tutorial: batch size 4", MNIST_SCRIPTS,
                     {"--batch-size", "--epochs", "test batch"}),
    "01-kai-sgd": ("01_dataparallel/README.md", "Kai Zhang's tutorial: plain SGD", MNIST_SCRIPTS, {"--lr", "momentum"}),
    "01-kai-inputs": ("01_dataparallel/README.md", "Kai Zhang's tutorial: `transforms.ToTensor()` alone", MNIST_SCRIPTS,
                      {"mean", "std"}),
    "06-blog-batch": ("06_amp_syncbn/README.md", "The blog's `resnet_ddp.py`: batch 256", CIFAR_SCRIPTS,
                      {"--batch-size", "--epochs", "--eval-every", "test batch"}),
    "06-blog-sgd": ("06_amp_syncbn/README.md", "The blog: SGD with learning rate 0.1", CIFAR_SCRIPTS,
                    {"--lr", "momentum", "weight decay"}),
    "06-blog-workers": ("06_amp_syncbn/README.md", "The blog: 8 DataLoader workers", CIFAR_SCRIPTS, {"workers"}),
    "06-blog-test-set": ("06_amp_syncbn/README.md", "The blog passes the test set through", CIFAR_SCRIPTS,
                         {"augmented", "std"}),
}


def notes_table(folder: str) -> str:
    """docs/source-notes.md's part for one section folder: from its heading to the next."""
    text = (REPO / "docs/source-notes.md").read_text()
    found = re.search(rf"^## {folder}: .*?(?=^## |\Z)", text, re.M | re.S)
    assert found, f"docs/source-notes.md has no part headed ## {folder}: ..."
    return found.group(0)


def course_cell(readme: str, begins: str) -> str:
    """The last cell ("the course does, and why") of the one row of the section's differences table (in
    docs/source-notes.md, under the section's folder) that begins so."""
    table = notes_table(Path(readme).parent.name)
    found = [line for line in table.splitlines() if line.startswith(f"| {begins}")]
    assert len(found) == 1, f"{readme}: {len(found)} rows of the differences table begin with {begins!r}"
    return re.split(r"(?<!\\)\|", found[0].strip().strip("|"))[-1].strip()


def stated(cell: str) -> dict:
    """The course's numbers, as the cell writes them: `--flag` N, momentum N, weight decay N, test batches of N,
    mean N and std N (or std (R, G, B)), "No workers", "only the training batches" (augmented)."""
    found = {flag: float(value) for flag, value in re.findall(r"`(--[a-z-]+)` (\d[\d.e-]*)", cell)}
    for key, pattern in (("momentum", r"momentum (\d[\d.e-]*)"), ("weight decay", r"weight decay (\d[\d.e-]*)"),
                         ("test batch", r"test batches of (\d+)"), ("mean", r"mean (\d[\d.]*) and std"),
                         ("std", r"std (\d[\d.]*)")):
        if match := re.search(pattern, cell):
            found[key] = float(match[1].rstrip("."))
    if match := re.search(r"std \(([\d., ]+)\)", cell):
        found["std"] = tuple(float(x) for x in match[1].split(","))
    if cell.startswith("No workers"):
        found["workers"] = 0
    if "only the training batches" in cell:
        found["augmented"] = "training batches only"
    return found


class _Parsed(BaseException):  # not an Exception: torchrun's @record lets it through untouched
    """Raised where a script's main() would parse its command line; carries the parser."""


@cache
def parser_of(script: str) -> argparse.ArgumentParser:
    """The parser a script's main() builds, caught before it parses anything: no data, no process group."""
    namespace = runpy.run_path(str(REPO / script), run_name="course_script")  # defines main() without calling it
    main = getattr(namespace["main"], "__wrapped__", namespace["main"])  # the function under @record

    def caught(parser, *args, **kwargs):
        raise _Parsed(parser)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", caught):
        try:
            main()
        except _Parsed as parsed:
            return parsed.args[0]
    raise AssertionError(f"{script}: main() returned without parsing its command line")


def in_code(script: str) -> dict:
    """What the script's code fixes, outside its flags: the same keys as stated()."""
    source = (REPO / script).read_text()
    mnist = Path(script).name.startswith("mnist")

    def only(values: list[str]):
        return float(values[0]) if len(set(values)) == 1 else sorted(set(values))

    test_loader = re.search(r"test_loader = .*?(?:batch_size=|batch_loader\(test_set, )(\d+)", source)
    augmented = re.findall(r"(?<!def )augment_cifar\((\w+)", source)
    trains_on = re.search(r"bar = tqdm\(train_loader.*\n.*\(images, labels\) in enumerate\(bar\)", source)
    return {
        "momentum": only(re.findall(r"momentum=([\d.e-]+)", source)),
        "weight decay": only(re.findall(r"weight_decay=([\d.e-]+)", source)),
        "test batch": float(test_loader[1]) if test_loader else None,
        "mean": common.MNIST_MEAN if mnist else common.CIFAR_MEAN,
        "std": common.MNIST_STD if mnist else common.CIFAR_STD,
        "workers": 0 if "num_workers" not in source else "num_workers set",
        "augmented": "training batches only" if augmented == ["images"] and trains_on
                     and "augment" not in inspect.getsource(common.evaluate) else augmented,
    }


@pytest.mark.parametrize("row", list(HYPERPARAMETER_ROWS))
def test_hyperparameter_rows_give_the_scripts_own_numbers(row):
    readme, begins, scripts, states = HYPERPARAMETER_ROWS[row]
    said = stated(course_cell(readme, begins))
    assert set(said) == states, f"{readme}, {begins!r}: the row states {sorted(said)}, not {sorted(states)}"
    for script in scripts:
        parser, code = parser_of(script), in_code(script)
        for key, value in said.items():
            real = parser.get_default(key[2:].replace("-", "_")) if key.startswith("--") else code[key]
            assert real == value, f"{readme}, {begins!r}: the row says {key} {value}, {script} has {real}"
