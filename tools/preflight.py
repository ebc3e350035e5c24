"""Check a training run before its processes start: one process, one line per mistake.

    python tools/preflight.py [--nproc N] [--nnodes M] SCRIPT [SCRIPT'S ARGUMENTS ...]
    python tools/preflight.py [--nproc N] --run PYTHON [-m LAUNCHER [ITS OPTIONS ...]] SCRIPT [SCRIPT'S ARGUMENTS ...]

The make targets run this before torchrun (or mp.spawn, or the launch scripts) starts N processes, so that a
mistake is one line instead of one traceback per process and torchrun's failure summary. It reads the script's
own argparse flags (by running the script's main() up to its parse_args()), then checks the numbers, the data
folder, the checkpoint folder and any checkpoint in it, a tcp:// or file:// --init-method and the ranks, the
devices and the backend for N processes per node, and prepares the data (a download, or the offline stand-in).
It prints what the run will use and exits 0, or prints one line and exits 2.

With --run it is given the whole command instead (the script is its first word that ends in .py), and when the
checks pass it prints the command and runs it in this same process, as `python -m torch.distributed.run ...` or
`python script.py ...` would: Python and torch start once, not twice. This process is replaced by the command
instead (exec) when the command names another interpreter or options for it, and when the checks have touched a
GPU: a launcher that stays for the whole run must not hold GPU memory.

A script started by hand skips all this and answers with argparse's and PyTorch's own messages.
"""

from __future__ import annotations

import argparse
import math
import os
import runpy
import shlex
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_PATH = sys.path[1:]  # the search path after its first entry (this folder), for the command --run runs here
_ERROR = argparse.ArgumentParser.error  # replaced by the course's one-line error while the checks run
sys.path[:0] = [str(REPO)]

import common  # noqa: E402
from tools import course, data  # noqa: E402


class _Parsed(Exception):
    """Raised at the script's parse_args(): the parser and the arguments, and nothing run after them."""


def parse_script_args(script: Path, argv: list[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The script's parser and parsed arguments, as its main() builds them; argparse errors are one line."""
    original = argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):
        raise _Parsed(self, original(self, args, namespace))

    original_error = argparse.ArgumentParser.error
    argparse.ArgumentParser.parse_args = capture
    argparse.ArgumentParser.error = course.ArgumentParser.error  # one line, with the notes' spellings explained
    sys.argv, sys.path[0] = [str(script), *argv], str(script.parent)
    try:
        runpy.run_path(str(script), run_name="__preflight__")["main"]()
    except _Parsed as parsed:
        return parsed.args
    finally:
        argparse.ArgumentParser.parse_args = original
    argparse.ArgumentParser.error = original_error
    raise SystemExit(f"{script}: main() returned without parsing its arguments")


def check_numbers(parser, args) -> None:
    for flag, low in (("epochs", 1), ("batch_size", 1), ("max_steps", 0), ("world_size", 1), ("nproc", 1),
                      ("nproc_per_node", 1), ("accum_steps", 1), ("eval_every", 1)):
        value = getattr(args, flag, None)
        if value is not None and value < low:
            parser.error(f"--{flag.replace('_', '-')} must be at least {low}, got {value}")
    for flag in ("lr", "timeout", "clip_grad"):
        value = getattr(args, flag, None)
        if value is not None and not (math.isfinite(value) and value > 0):
            parser.error(f"--{flag.replace('_', '-')} must be a positive number, got {value}")


def place(parser, args, nproc: int, nnodes: int) -> tuple[int, int, int, int]:
    """(rank, local rank, world size, processes per node) of the first process the launch starts."""
    if getattr(args, "init_method", None) is None:
        return 0, 0, getattr(args, "nproc", None) or nproc * nnodes, getattr(args, "nproc", None) or nproc
    if args.node_rank and args.nproc_per_node is None:
        parser.error("give --node-rank with --nproc-per-node (processes on each machine) and --local-rank")
    per_node = args.nproc_per_node or args.world_size
    if args.nproc_per_node is None and args.world_size > 1:  # Kai Zhang's two-node commands give --rank alone
        print(f"NOTE: --rank without --nproc-per-node: all {args.world_size} processes are taken to run on this "
              f"machine; on machines of N GPUs each, add --nproc-per-node N")
    if args.rank is None and args.local_rank is None:
        parser.error("give --rank, or --node-rank with --nproc-per-node and --local-rank")
    rank = args.rank if args.rank is not None else args.node_rank * per_node + args.local_rank
    local = args.local_rank if args.local_rank is not None else rank % per_node
    if not 0 <= local < per_node:
        parser.error(f"--local-rank {local}: local ranks run from 0 to --nproc-per-node - 1 ({per_node - 1})")
    return rank, local, args.world_size, per_node


def check_checkpoint(parser, args, script: Path, device) -> None:
    """A checkpoint the run would continue must load, be this script's, and hold a GradScaler state if this run
    needs one (fp16): a run without fp16 saves an empty one, which GradScaler.load_state_dict refuses."""
    path = Path(args.checkpoint_dir or "") / f"{script.stem}.pt"
    if not args.checkpoint_dir or not path.exists():
        return
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - damaged, truncated, not a torch file: the same to a user
        parser.error(f"{path} is damaged or not a checkpoint (torch.load: {type(err).__name__}); move it away "
                     f"or use another --checkpoint-dir to start over")
    missing = [key for key in ("model", "optimizer", "epoch") if not isinstance(state, dict) or key not in state]
    if missing:
        parser.error(f"{path} is not a checkpoint of {script.name} (no {', '.join(missing)}); move it away or use "
                     f"another --checkpoint-dir")
    amp = getattr(args, "amp", None)
    if amp == "auto":  # as the scripts choose: bf16 where the device computes in it
        amp = "bf16" if device.type == "cpu" or torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"
    if amp == "fp16" and "scaler" in state and not state["scaler"]:
        parser.error(f"{path} was saved by a run without fp16 (no GradScaler state) and this run uses fp16: "
                     f"continue it with that run's --amp, or use another --checkpoint-dir")


def check_sharded_checkpoint(parser, args, script: Path) -> None:
    """A sharded checkpoint (torch.distributed.checkpoint) the run would continue, DIR/<script>/ as mnist_fsdp2.py
    writes it, must be whole and this course's model: .metadata is written last, after every rank's shards, so a
    folder without it was cut off when a rank died; every shard file must hold the bytes .metadata points to; the
    model's names and shapes must be the course's ConvNet's (ResNet-18's for a CIFAR script). Refused, it is left as
    it is: the run never starts, so it never writes over it."""
    folder = Path(args.checkpoint_dir or "") / script.stem
    if not args.checkpoint_dir or not folder.is_dir():
        return
    import torch.distributed.checkpoint as dcp

    import common

    fix = "move it away or use another --checkpoint-dir to start over"
    if not (folder / ".metadata").is_file():
        parser.error(f"{folder} is half-written (no .metadata: a rank died while saving it); {fix}")
    try:
        meta = dcp.FileSystemReader(str(folder)).read_metadata()
    except Exception as err:  # noqa: BLE001 - truncated, garbage, another format: the same to a user
        parser.error(f"{folder}/.metadata is damaged ({type(err).__name__}); {fix}")
    for info in meta.storage_data.values():
        shard = folder / info.relative_path
        if not shard.is_file() or shard.stat().st_size < info.offset + info.length:
            parser.error(f"{shard} is missing or cut short: the sharded checkpoint is damaged; {fix}")
    model = common.resnet18_cifar() if "cifar" in script.name else common.ConvNet()
    expected = {f"model.{key}": tuple(value.shape) for key, value in model.state_dict().items()}
    saved = {key: tuple(m.size) for key, m in meta.state_dict_metadata.items()
             if key.startswith("model.") and hasattr(m, "size")}
    if saved != expected or "epoch" not in meta.state_dict_metadata:
        parser.error(f"{folder} is not a checkpoint of {script.name} (another model's weights, or no epoch); {fix}")


def check_compiler(parser, args, device) -> None:
    """--compile on the CPU: inductor writes C++ and builds it with the system's C++ compiler (g++, or $CXX)."""
    if getattr(args, "compile", None) != "inductor" or device.type != "cpu":
        return
    from torch._inductor import cpp_builder

    try:
        cpp_builder.get_cpp_compiler()
    except Exception:  # noqa: BLE001 - InvalidCxxCompiler, or what a broken compiler raises
        parser.error("--compile on the CPU: inductor builds C++ and finds no C++ compiler (g++, or the one $CXX "
                     "names); install one (apt install g++), or use --compile aot_eager")


def check_gpus(parser, args, device) -> None:
    """nn.DataParallel's --gpus and --output-device must name GPUs that are there."""
    if getattr(args, "gpus", None) is None and getattr(args, "output_device", None) is None:
        if getattr(args, "gpus", 0) is None and args.device == "cpu" and common.usable_gpus():
            parser.error("--device cpu: DataParallel only splits work over GPUs; for the CPU use mnist_single.py")
        return
    gpus = common.usable_gpus()
    if device.type != "cuda":
        parser.error("--gpus and --output-device need CUDA GPUs; on the CPU, DataParallel has nothing to split")
    for gpu in (args.gpus or []) + ([args.output_device] if args.output_device is not None else []):
        if not 0 <= gpu < gpus:
            parser.error(f"GPU {gpu} does not exist: this machine has {gpus} (ids 0..{gpus - 1})")
    chosen = args.gpus or list(range(gpus))
    if args.output_device is not None and len(chosen) == 1 and args.output_device != chosen[0]:
        parser.error("with one GPU, DataParallel just calls the model (nothing to gather): --output-device "
                     "must be that GPU")


def makes_process_group(script: Path) -> bool:
    """Whether the script starts a process group: one that makes none (mnist_single.py, mnist_dataparallel.py) has
    no backend to report, whatever its --backend flag says."""
    return "init_process_group" in script.read_text(encoding="utf-8", errors="replace")


def split_command(command: list[str]) -> tuple[Path, list[str]]:
    """The script of `python script.py ARGS` or `python -m launcher [OPTIONS] script.py ARGS`, and its arguments."""
    for i, word in enumerate(command[1:], 1):
        if word.endswith(".py"):
            return Path(word), command[i + 1:]
    raise SystemExit(f"preflight: no .py script in the command to run: {' '.join(command)}")


def run_here(command: list[str]) -> None:
    """Run `python -m module ARGS` or `python script.py ARGS` in this process, as that command would run."""
    print(shlex.join(command), flush=True)  # the command, as make prints the commands it starts
    python, *rest = command
    other = os.path.abspath(shutil.which(python) or python) != os.path.abspath(sys.executable)
    options = rest[0].startswith("-") and rest[0] != "-m"  # python -u, -X ...: as given, by that interpreter
    torch = sys.modules.get("torch")
    if other or options or (torch is not None and torch.cuda.is_initialized()):
        os.execvp(python, command)
    argparse.ArgumentParser.error = _ERROR  # the command's own argparse messages, as by hand
    if rest[0] == "-m":
        sys.argv, sys.path = [rest[1], *rest[2:]], [os.getcwd(), *_PATH]
        runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv, sys.path = rest, [str(Path(rest[0]).resolve().parent), *_PATH]
        runpy.run_path(rest[0], run_name="__main__")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=1, help="processes per node the launch will start")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes of the job")
    parser.add_argument("--run", action="store_true",
                        help="the arguments are the whole command (python [-m launcher ...] script.py ...): run it "
                             "in this process when the checks pass")
    parser.add_argument("script", type=Path)
    parser.add_argument("args", nargs=argparse.REMAINDER)
    opts = parser.parse_args(argv)
    command = [str(opts.script), *opts.args]
    if opts.run:
        opts.script, opts.args = split_command(command)
    script_parser, args = parse_script_args(opts.script.resolve(), opts.args)
    check_numbers(script_parser, args)
    rank, local_rank, world_size, per_node = place(script_parser, args, opts.nproc, opts.nnodes)
    script_parser.family = "cifar10" if "cifar" in opts.script.name else "mnist"
    device, backend = course.check_args(script_parser, args, rank=rank, world_size=world_size,
                                        local_rank=local_rank, procs_per_node=per_node)
    check_gpus(script_parser, args, device)
    check_checkpoint(script_parser, args, opts.script, device)
    check_sharded_checkpoint(script_parser, args, opts.script)
    check_compiler(script_parser, args, device)
    print(course.runtime_report(device, backend if makes_process_group(opts.script) else None, per_node))
    try:
        data.prepare(args.dataset, args.data_dir, family=script_parser.family)
    except course.UsageError as err:
        script_parser.error(str(err))
    if opts.run:
        run_here(command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
