"""The source notes' own command lines, with the course's scripts: each one runs, or fails in one line that names
the course's way. Runs are checks only (make's preflight, or COURSE_CHECK_ONLY=1 for the other scripts: the
flags are parsed and checked, the data prepared, then the script stops), all in one interpreter, so that every
command costs well under a second."""

import re
import shlex
from pathlib import Path

import pytest

from harness import exits

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
     "--learning_rate 0.1 --random_seed 0 --model_dir saved_models", True, "--num_epochs -> --epochs"),
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


CHAIN = ("mnist_single", "mnist_spawn", "mnist_torchrun", "mnist_tcp", "mnist_amp_syncbn")


def call(command: str, launched: bool, data_dir: Path) -> tuple:
    """The chain scripts are checked by make's preflight; the others check themselves (COURSE_CHECK_ONLY)."""
    script, *argv = shlex.split(command)
    if "spawn_per_node" not in command:
        argv += ["--data-dir", str(data_dir)]
    if Path(script).stem in CHAIN:
        return "tools/preflight.py", [script, *argv], {}
    return script, argv, {**(LAUNCHED if launched else {}), "COURSE_CHECK_ONLY": "1"}


@pytest.mark.slow
def test_the_notes_commands_run_or_name_the_course_way(data_dir):
    results = exits([call(c[1], c[2], data_dir) for c in NOTES_COMMANDS])
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
