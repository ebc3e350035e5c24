"""Break the distributed part of each DDP chain script (and cifar_resnet.py) on purpose; a trace check must turn
red for every break.

    python tools/mutants.py                                    # every script, every mutation (about 30 s on 2 cores)
    python tools/mutants.py --only no-set-epoch --scripts 03_ddp_torchrun/mnist_torchrun.py
    make mutants

For each script the unchanged copy runs first and must pass every check; then each mutation replaces one piece
of it (the sampler, set_epoch, the DDP wrap, the evaluation all_reduce, the evaluation split, the buffer
broadcast, the checkpoint's writer and its restore, LOCAL_RANK) in a copy, runs it with 2 ranks for 2 short epochs
(1 where the break shows in one: all but set_epoch's), with a checkpoint after each where the writer is the point,
and reads the trace (tools/tracer.py) with
tools/tracecheck.py. A mutation is caught when the check named for it says "wrong". Exit code 1 if any mutation
survives or an unchanged script fails a check.

mnist_spawn.py, mnist_torchrun.py and mnist_tcp.py share one train() (only their launchers differ): a break
inside it is run on the first of them; the others run the breaks outside it, and two inside (set_epoch, the
evaluation all_reduce) that show their launcher's processes are traced. Likewise a break of a line that
cifar_resnet.py holds letter for letter as mnist_amp_syncbn.py does runs on mnist_amp_syncbn.py. If the code
ever differs, each runs every break.

The torchrun scripts run as two nodes of one process each, every node with its own data folder (as on machines
with their own disks): RANK and LOCAL_RANK differ there. cifar_resnet.py also runs 1 epoch with --amp fp16 (a
GradScaler with a state) and is started once more to continue from that checkpoint (the resume check); the break
of the restore continues from the unchanged script's first epoch, which it cannot change.

The ranks are forked from this process, which imports torch once (a launch costs a second, not ten); they get
torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...), or the tcp:// arguments for mnist_tcp.py,
and mnist_spawn.py's mp.spawn forks too.
"""

from __future__ import annotations

import argparse
import ast
import gc
import os
import runpy
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO)]

from tools import tracecheck, tracer  # noqa: E402

SCRIPTS = {  # script: how its ranks start
    "02_ddp_spawn/mnist_spawn.py": "spawn",
    "03_ddp_torchrun/mnist_torchrun.py": "torchrun",
    "04_multinode_tcp/mnist_tcp.py": "tcp",
    "06_amp_syncbn/mnist_amp_syncbn.py": "torchrun",
    "06_amp_syncbn/cifar_resnet.py": "torchrun",
    "07_beyond_ddp/mnist_fsdp2.py": "torchrun",
}
# FSDP2 has no DDP wrap to break (its break: a root never sharded), and the buffers check reads DDP modules. Its
# data side (sampler, set_epoch, evaluation) is the chain's and is checked as theirs.
# Its checkpoint is written by every rank (torch.distributed.checkpoint, a shard each): no single writer to break.
NOT_FOR = {"07_beyond_ddp/mnist_fsdp2.py": {"bare-model", "no-buffer-broadcast", "every-rank-saves"}}
TORCHRUN = {rel for rel, how in SCRIPTS.items() if how == "torchrun"}
# the GradScaler's restore on resume: cifar_resnet.py's (mnist_amp_syncbn.py's: tests/test_06_amp_syncbn.py resumes it)
SCALER = {"06_amp_syncbn/cifar_resnet.py"}
ONLY_FOR = {"root-not-sharded": {"07_beyond_ddp/mnist_fsdp2.py"}, "scaler-not-restored": SCALER,
            "rank-for-local-rank": TORCHRUN}
CHECKS_FOR = {"07_beyond_ddp/mnist_fsdp2.py": {"shards", "order", "ddp", "eval", "eval_sum", "writer", "ran"}}
# each run: 2 short epochs on a small stand-in (ResNet-18 on a CPU: a few small batches). No --accum-steps for
# cifar_resnet.py: the bare-model break puts in DataParallel, which has no no_sync(). On the CPU also on a GPU
# machine: the two-node runs give every rank local rank 0, and NCCL refuses two ranks on one GPU
ARGS = {"mnist": ["--dataset", "mnist-standin", "--epochs", "2", "--max-steps", "3", "--device", "cpu"],
        "cifar": ["--dataset", "cifar10-standin", "--epochs", "2", "--max-steps", "1", "--batch-size", "2",
                  "--device", "cpu"]}

MUTANTS = {  # name: (what it breaks, the original code, the mutated code, the check that must catch it)
    "sampler-rank-0": ("every rank takes rank 0's shard",
                       "num_replicas=world_size, rank=rank,", "num_replicas=world_size, rank=0,", "shards"),
    "no-set-epoch": ("every epoch repeats the first epoch's order",
                     "        sampler.set_epoch(epoch)", "        pass", "order"),
    "bare-model": ("no gradient is averaged: each rank trains its own model",
                   "model = DDP(model,", "model = torch.nn.DataParallel(model,", "ddp"),
    "no-eval-all-reduce": ("each rank reports its own part of the test set",
                           "        dist.all_reduce(totals)", "        pass", "eval_sum"),
    "same-eval-part": ("every rank evaluates the same part of the test set",
                       "range(rank, len(test_set), world_size)", "range(0, len(test_set), world_size)", "eval"),
    "no-buffer-broadcast": ("every rank evaluates with its own BatchNorm statistics",
                            "            dist.broadcast(buffer, src=0)", "            pass", "buffers"),
    "root-not-sharded": ("the root's own parameters (fc) stay whole on each rank and train there alone",
                         "    fully_shard(model, mesh=mesh, mp_policy=policy)", "    pass", "ddp"),
    "no-distributed-sampler": ("a plain shuffling loader: every rank trains on the whole data set",
                               "sampler=sampler,", "shuffle=True,", "shards"),
    "wrong-num-replicas": ("the data cut for one rank more than there are: a shard is never trained on",
                           "num_replicas=world_size, rank=rank,", "num_replicas=world_size + 1, rank=rank,", "shards"),
    "every-rank-saves": ("every rank writes the checkpoint file, at the same time",
                         "if rank == 0 and path:", "if path:", "writer"),
    "scaler-not-restored": ("a resumed run starts its GradScaler afresh",
                            'scaler.load_state_dict(state["scaler"])', "pass", "resume"),
    "rank-for-local-rank": ("RANK read where LOCAL_RANK belongs: on the second node no process prepares its data",
                            'int(os.environ["LOCAL_RANK"])', 'int(os.environ["RANK"])', "ran"),
}


def mutations(rel: str) -> list[str]:
    """The mutations that apply to the script `rel`: every one, except those NOT_FOR it and those ONLY_FOR others."""
    return [name for name in MUTANTS if name not in NOT_FOR.get(rel, set()) and rel in ONLY_FOR.get(name, {rel})]


PLUMBING = ("no-set-epoch", "no-eval-all-reduce")  # a twin's launcher still shows its loaders and collectives


def train_code(rel: str) -> str:
    """The script's train() function, its own file name taken out (the checkpoint is named after the script)."""
    source = (REPO / rel).read_text()
    node = next((n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "train"), None)
    return "" if node is None else ast.get_source_segment(source, node).replace(Path(rel).stem, "SCRIPT")


# cifar_resnet.py's loop is its own, but its sampler, evaluation, buffer broadcast, DDP wrap, checkpoint writer and
# LOCAL_RANK lines are mnist_amp_syncbn.py's, letter for letter, under the same launcher: such a break runs there
LINE_TWINS = {"06_amp_syncbn/cifar_resnet.py": "06_amp_syncbn/mnist_amp_syncbn.py"}


def line_of(rel: str, name: str) -> str:
    """The whole source line of `rel` that the mutation `name` changes."""
    return next(line for line in (REPO / rel).read_text().splitlines() if MUTANTS[name][1] in line)


def twin_covered(rel: str, ran: dict[str, set[str]]) -> dict[str, tuple[str, str]]:
    """The mutations of `rel` that a script checked before it ran: {mutation: ("train()" or "line", that script)};
    ran: {script: the mutations run on it}.
    When two train() functions are the same code (mnist_spawn.py, mnist_torchrun.py and mnist_tcp.py differ only in
    how their processes start), a break inside train() is the same break; for LINE_TWINS, a break of a line that
    both scripts hold letter for letter. The others, and PLUMBING, run again."""
    code, covered = train_code(rel), {}
    for other, done in ran.items():
        if code and train_code(other) == code:
            covered.update({name: ("train()", other) for name in mutations(rel) if name not in PLUMBING
                            and name in done and MUTANTS[name][1] in code and name not in covered})
    twin = LINE_TWINS.get(rel)
    for name in mutations(rel):
        if (twin in ran and name not in PLUMBING and name in ran[twin]
                and line_of(rel, name) == line_of(twin, name)):
            covered.setdefault(name, ("line", twin))
    return covered


def mutate(source: str, name: str) -> str:
    _, old, new, _ = MUTANTS[name]
    if source.count(old) != 1:
        raise ValueError(f"mutation {name}: {old!r} found {source.count(old)} times, not once")
    return source.replace(old, new)


def _child(script: Path, argv: list[str], env: dict, trace_dir: Path, log: Path) -> None:
    """In a forked process: run `script` as __main__ with a fresh trace, and never return."""
    code = 1
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.environ.update(env)
        tracer._state.update(dir=str(trace_dir), pid=None, batches=0, passes=0, args={})
        import torch

        torch.set_num_threads(1)
        sys.argv, sys.path[0] = [str(script), *argv], str(script.parent)
        if env.get("COURSE_FORK_SPAWN"):  # mp.spawn, but forking: no fresh interpreter per rank
            import torch.multiprocessing as mp

            mp.spawn = lambda fn, args=(), nprocs=1, join=True, **_: mp.start_processes(
                fn, args, nprocs, join, start_method="fork")
        runpy.run_path(str(script), run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException as error:  # noqa: BLE001 - the traceback goes to the log
        import traceback

        traceback.print_exc()
        tracer.record("error", lines=traceback.format_exception(error)[-6:])
    finally:
        if code == 0:
            tracer._exiting()  # what atexit does in a real run (os._exit skips it)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run(script: Path, how: str, args: list[str], trace_dir: Path, timeout: float = 120,
        nproc: int = 2, nodes: int = 1, rank_args=None) -> tuple[list[int], str]:
    """Start the ranks of `script` (`nproc` of them, spread over `nodes` simulated nodes for torchrun's kind) and
    wait; (exit codes, their output). rank_args(rank) adds arguments to one rank's (torchrun's kind)."""
    trace_dir.mkdir(parents=True, exist_ok=True)
    import common

    port = common.free_port()
    base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    if how == "spawn":
        ranks = [([*args, "--nproc", str(nproc)], {**base, "COURSE_FORK_SPAWN": "1"})]
    elif how == "tcp":
        ranks = [([*args, "--init-method", f"tcp://127.0.0.1:{port}", "--world-size", "2", "--rank", str(r)], base)
                 for r in range(2)]
    else:
        per_node = nproc // nodes
        ranks = [([*args, *(rank_args(r) if rank_args else [])],
                  {**base, "RANK": str(r), "LOCAL_RANK": str(r % per_node), "WORLD_SIZE": str(nproc),
                   "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(r // per_node)}) for r in range(nproc)]
    pids = []
    # what this process holds (torch, torchvision: most of it) moves out of the collector's sight before the forks:
    # a script's gc.collect() then walks its own objects, not ours, nor copies our pages by touching them (measured
    # 2026-11-27: the whole check alone 45 s and 68 CPU-s before, 30 s and 41 CPU-s after, on 2 cores)
    gc.freeze()
    for r, (argv, env) in enumerate(ranks):
        log = trace_dir / f"log-{r}.txt"
        pid = os.fork()
        if pid == 0:
            os.setpgid(0, 0)
            _child(script, argv, env, trace_dir, log)
        pids.append(pid)
    gc.unfreeze()
    codes, deadline = {}, time.time() + timeout
    while len(codes) < len(pids) and time.time() < deadline:
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    for pid in pids:
        if pid not in codes:  # timed out: stop its whole process group (mp.spawn's children too)
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            codes[pid] = -9
    output = "".join((trace_dir / f"log-{r}.txt").read_text(errors="replace") for r in range(len(ranks)))
    return [codes[p] for p in pids], output


def check_script(rel: str, data_dir: str, work: Path, only: list[str] | None = None,
                 skip: list[str] = ()) -> list[dict]:
    """The unchanged script and each mutation of it: one row each (name, exit codes, checks, caught). data_dir: the
    first node's data folder (prepared); the second node's starts empty where LOCAL_RANK is the point."""
    script = REPO / rel
    args = [*ARGS["cifar" if "cifar" in rel else "mnist"], "--data-dir", data_dir, "--timeout", "30"]
    how = SCRIPTS[rel]
    nodes = 2 if how == "torchrun" else 1
    rows = []
    for name in ["unchanged", *[m for m in only or MUTANTS if m in mutations(rel) and m not in skip]]:
        copy = work / name.replace("-", "_") / script.name
        copy.parent.mkdir(parents=True, exist_ok=True)
        source = script.read_text()
        copy.write_text(source if name == "unchanged" else mutate(source, name))
        for helper in script.parent.glob("*.py"):  # what the script imports from its own folder
            if helper.name != script.name:
                (copy.parent / helper.name).write_text(helper.read_text())
        second = copy.parent / "node1-data"  # the second node's own disk: its first process prepares it ...
        if nodes > 1 and name not in ("unchanged", "rank-for-local-rank"):
            shutil.copytree(Path(data_dir) / "standin", second / "standin")  # ... here done already (faster)
        node_dirs = (lambda r, d=str(second): ["--data-dir", data_dir if r == 0 else d]) if nodes > 1 else None
        codes, output, checks = [], "", []
        if name != "scaler-not-restored":
            saves = ["--checkpoint-dir", str(copy.parent / "checkpoint")] if name in ("unchanged", "every-rank-saves") \
                else []  # the writer check's runs; the others need no checkpoint
            # one epoch shows every break but set_epoch's (the order of a second epoch) and the unchanged run's
            epochs = [] if name in ("unchanged", "no-set-epoch") else ["--epochs", "1"]
            codes, output = run(copy, how, [*args, *epochs, *saves], copy.parent / "trace", nodes=nodes,
                                rank_args=node_dirs)
            checks = [c for c in tracecheck.judge(copy.parent / "trace", tracecheck.CHECKS + tracecheck.MORE)
                      if c.name != "resume"]
        if rel in SCALER and name in ("unchanged", "scaler-not-restored"):
            # fp16: a GradScaler with a state to save; 1 epoch, then a second launch continues for another. The
            # break is in the restore, which the first launch never reaches: its checkpoint is the unchanged one's
            first = work / "checkpoint-fp16-epoch-1"
            fp16 = [*args, "--amp", "fp16", "--checkpoint-dir", str(copy.parent / "checkpoint-fp16")]
            for epochs in (1, 2):
                if epochs == 1 and name != "unchanged" and first.exists():
                    shutil.copytree(first, copy.parent / "checkpoint-fp16")
                    continue
                more, out = run(copy, how, [*fp16, "--epochs", str(epochs)], copy.parent / f"trace-fp16-{epochs}",
                                nodes=nodes, rank_args=node_dirs)
                codes, output = codes + more, output + out
                if epochs == 1 and name == "unchanged" and more == [0] * len(more):
                    shutil.copytree(copy.parent / "checkpoint-fp16", first)
            checks += tracecheck.judge(copy.parent / "trace-fp16-2", (tracecheck.check_resume,))
        red = [c.name for c in checks if c.verdict == "wrong" and c.name in CHECKS_FOR.get(rel, {c.name})]
        expected = None if name == "unchanged" else MUTANTS[name][3]
        ok = (not red and codes == [0] * len(codes)) if expected is None else expected in red
        if expected is None and rel in SCALER and not any(c.name == "resume" and c.verdict == "ok" for c in checks):
            ok = False  # the resume check must have seen a restored GradScaler: it is never "ok" on nothing
        rows.append({"script": rel, "mutation": name, "codes": codes, "red": red, "expected": expected, "ok": ok,
                     "checks": [str(c) for c in checks], "output": output[-3000:]})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Break each DDP script's distributed part; the trace must tell.")
    parser.add_argument("--scripts", nargs="+", default=list(SCRIPTS), choices=list(SCRIPTS))
    parser.add_argument("--only", nargs="+", choices=list(MUTANTS), help="these mutations only")
    args = parser.parse_args(argv)
    import torch._dynamo  # noqa: F401 - a DDP wrap imports it (about a second): once here, not in every forked rank
    import torchvision.models  # noqa: F401 - the same for ResNet-18's module (cifar_resnet.py)

    import common
    from tools import standins

    tracer.install(tempfile.mkdtemp(prefix="course-trace-"))
    failed = 0
    with tempfile.TemporaryDirectory(prefix="course-mutants-") as work:
        # the breaks show on any data: small stand-ins keep each run about a second; the ranks are forked from here,
        # so a second node's first process writes the same small stand-in into its own folder
        standins.STANDIN_SIZES = {**standins.STANDIN_SIZES, "mnist": (2400, 400), "cifar10": (200, 10)}
        data_dir = str(Path(work) / "data")  # the first node's
        common.prepare_data("mnist-standin", data_dir)
        common.prepare_data("cifar10-standin", data_dir, family="cifar10")
        ran = {}  # script: the mutations run on it
        for rel in args.scripts:
            covered = {m: how for m, how in twin_covered(rel, ran).items() if not args.only or m in args.only}
            ran[rel] = {m for m in args.only or MUTANTS if m in mutations(rel) and m not in covered}
            for name, (what, other) in covered.items():
                print(f"{rel:38} {name:22} same {what} as {other}: caught there", flush=True)
            for row in check_script(rel, data_dir, Path(work) / Path(rel).stem, args.only, covered):
                what = ("passes every check" if row["expected"] is None else
                        f"caught by {row['expected']}" if row["ok"] else f"SURVIVED ({row['expected']} stayed green)")
                if row["expected"] is None and not row["ok"]:
                    what = f"FAILS: exit codes {row['codes']}, red checks {row['red']}"
                print(f"{rel:38} {row['mutation']:22} {what}", flush=True)
                if not row["ok"]:
                    failed += 1
                    print("    " + "\n    ".join(row["checks"]) + "\n" + row["output"][-1500:])
    print(f"{'all caught' if not failed else f'{failed} problem(s)'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
