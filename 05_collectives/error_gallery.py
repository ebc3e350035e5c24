"""The errors everyone meets with DDP, each one made on purpose: the real message, its cause, and the fix, running.

    python 05_collectives/error_gallery.py                   # every case: broken, then fixed; a table at the end
    python 05_collectives/error_gallery.py --cases uneven-inputs,unused-parameters
    make errors

Each case runs twice, broken and fixed side by side, each as 2 processes on the CPU (Gloo) with the environment
torchrun gives its workers (RANK, WORLD_SIZE, MASTER_ADDR, ...; when one fails, the other has 3 s to end by
itself, then is stopped), with a process-group timeout of 5 s where the broken variant hangs (30 s elsewhere, so
that a rank that starts late on busy cores is no error). The broken variant must fail with the
quoted message (or hang and be stopped by that timeout), and the fixed variant must succeed. One case
(inplace-buffers) is an error of torch 2.11 that 2.14.1 no longer raises: there both variants must run. The driver
checks all this and exits with 1 if any case does not behave so. Four cases run at a time (16 light processes, 1
thread each): the timeout cases spend their seconds waiting; the report keeps the order of the cases.
Started by torchrun with --case and --variant, the script runs one rank of that case, as the driver's workers do:
    torchrun --standalone --nproc-per-node 2 05_collectives/error_gallery.py --case uneven-inputs --variant broken
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import common
import workarounds
from tools import course

INPLACE = "modified by an inplace operation"  # the one case that fails in torch 2.11.0 and runs in 2.14.1
TIMEOUT = 5.0  # seconds a collective may wait in a broken variant that hangs until the timeout
PATIENT = 30.0  # everywhere else: a rank that starts late on busy cores must not turn into a timeout
GRACE = 3.0  # seconds a rank may still take to fail by itself after its peer failed


# --------------------------------------------------------------------------- the cases (run by each rank)


class TwoHeads(nn.Module):
    """A model whose second head is used only when asked: its parameters get no gradient otherwise."""

    def __init__(self):
        super().__init__()
        self.body, self.head, self.spare = nn.Linear(10, 10), nn.Linear(10, 5), nn.Linear(10, 5)

    def forward(self, x, use_spare=False):
        h = torch.relu(self.body(x))
        return self.spare(h) if use_spare else self.head(h)


def unused_parameters(rank, variant):
    """A parameter that gets no gradient: DDP waits for it, and the next iteration finds the last one unfinished."""
    def steps(model, n=3):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        start = time.perf_counter()
        for _ in range(n):
            optimizer.zero_grad()
            model(torch.randn(8, 10)).sum().backward()
            optimizer.step()
        return (time.perf_counter() - start) / n * 1000

    torch.manual_seed(0)
    if variant == "broken":
        steps(DDP(TwoHeads()))
        return
    costs = {"find_unused_parameters=True": steps(DDP(TwoHeads(), find_unused_parameters=True), 20),
             "static_graph=True": steps(DDP(TwoHeads(), static_graph=True), 20),
             "the model without the unused head": steps(DDP(nn.Sequential(nn.Linear(10, 10), nn.ReLU(),
                                                                           nn.Linear(10, 5))), 20)}
    course.print0(rank, "fixed three ways, ms per step: " + "; ".join(f"{k} {v:.2f}" for k, v in costs.items()))


def uneven_inputs(rank, variant):
    """Rank 0 has one batch more than rank 1: its last backward all-reduces with nobody."""
    from torch.distributed.algorithms.join import Join

    model = DDP(nn.Linear(10, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [torch.randn(4, 10) for _ in range(3 if rank == 0 else 2)]

    def loop():
        for x in batches:
            optimizer.zero_grad()
            model(x).sum().backward()
            optimizer.step()

    if variant == "broken":
        loop()
    else:
        with Join([model]):  # ranks that run out of data shadow the others' all-reduces with zeros
            loop()
        course.print0(rank, "Join: rank 0 ran 3 steps, rank 1 ran 2, and both finished")


def inplace_buffers(rank, variant):
    """Two forwards before one backward, with BatchNorm in eval mode (frozen statistics, as in fine-tuning):
    DDP copies rank 0's buffers into the running statistics before each forward, in place, and the first
    forward's autograd graph had saved them. torch 2.11 fails here (the gallery shows its message); torch 2.14.1
    makes that copy without bumping the buffers' version counters, so both variants run."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(10, 10), nn.BatchNorm1d(10), nn.Linear(10, 1))
    net[1].eval()  # frozen BatchNorm: the forward uses running_mean and running_var
    # torch 2.14 calls the flag forward_sync_buffers; torch 2.11 calls it broadcast_buffers
    flag = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters
            else "broadcast_buffers")
    model = DDP(net, **{flag: variant == "broken"})
    a, b = torch.randn(8, 10), torch.randn(8, 10)
    (model(a).sum() + model(b).sum()).backward()
    course.print0(rank, f"{flag}={variant == 'broken'}: two forwards, one backward, no error")


def different_models(rank, variant):
    """Every rank must build the same model; DDP compares them when it wraps."""
    width = 10 if variant == "fixed" or rank == 0 else 12
    DDP(nn.Sequential(nn.Linear(10, width), nn.ReLU(), nn.Linear(width, 5)))
    course.print0(rank, "every rank built the same model")


def no_process_group(rank, variant):
    """A collective before init_process_group (the driver starts this case without a group)."""
    if variant == "fixed":
        dist.init_process_group("gloo", timeout=timedelta(seconds=PATIENT))
    dist.all_reduce(torch.ones(1))
    course.print0(rank, "all_reduce after init_process_group: fine")


def after_destroy(rank, variant):
    """A collective after destroy_process_group, such as a last metric all-reduced in a `finally`."""
    x = torch.ones(1)
    if variant == "broken":
        dist.barrier()  # every rank connected first: a group destroyed at once can fail a slower rank's init
        dist.destroy_process_group()
    dist.all_reduce(x)
    course.print0(rank, f"the all_reduce came before destroy_process_group: {x.item():g}")


def racing_checkpoint(rank, variant):
    """Every rank writing the same checkpoint file at once: the pieces of two writers interleave."""
    path = Path(os.environ.get("GALLERY_TMP", tempfile.gettempdir())) / "model.pt"  # a folder all ranks see
    state = {"rank": rank, "weights": torch.full((100_000,), float(rank))}  # what each rank would save
    if variant == "broken":
        data = _torch_bytes(state)
        if rank == 0:
            open(path, "wb").close()
        dist.barrier()
        with open(path, "r+b") as f:  # both ranks write the same file
            for piece, start in enumerate(range(0, len(data), 65536)):
                if piece % 2 == rank:  # taking turns, as two writers would by chance on a shared file system
                    f.seek(start)
                    f.write(data[start:start + 65536])
                    f.flush()
                dist.barrier()
    else:
        if rank == 0:  # one writer, through a temp file and a rename
            course.atomic_save(state, path)
        dist.barrier()  # nobody reads before it is written
    loaded = torch.load(path, weights_only=True)  # every rank reads it back
    values = sorted(set(loaded["weights"].tolist()))
    if len(values) > 1:
        raise RuntimeError(f"torn checkpoint: {path} loads, but its weights mix the ranks' writes {values}")
    course.print0(rank, f"rank 0 wrote, every rank read the weights of rank {loaded['rank']}: all {values[0]:g}")


def _torch_bytes(obj) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def eval_through_wrapper(rank, variant):
    """Evaluation under no_grad through the DDP wrapper: the first forward after a training step broadcasts the
    buffers. A rank with no evaluation batch leaves that broadcast without a partner."""
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(10, 10), nn.BatchNorm1d(10), nn.Linear(10, 1)))
    model(torch.randn(8, 10)).sum().backward()  # a training step: the next forward will sync the buffers
    batches = [torch.randn(8, 10) for _ in range(3 if rank == 0 else 1)]  # uneven, but nobody empty
    with torch.no_grad():
        for x in batches if variant == "fixed" else (batches if rank == 0 else []):  # broken: rank 1 has none
            model(x)
    total = torch.tensor([float(len(batches))])
    dist.all_reduce(total)  # the metrics: the next collective every rank calls
    if variant == "fixed":
        with torch.no_grad():  # and the course's way, through model.module: no hidden collective
            for x in batches if rank == 0 else []:
                model.module(x)
        dist.all_reduce(total)
    course.print0(rank, f"uneven evaluation batches (3 and 1) through the wrapper: fine; metrics {total.item():g}")


# Gloo's timeout in the words of whichever rank notices it first; the other rank then sees its peer gone
GLOO_TIMEOUT = ("Timed out waiting", "Application timeout caused pair closure")
CASES = {  # name: (function, the message(s) of the broken variant (None: it runs in this torch), cause, fix)
    "unused-parameters": (unused_parameters,
                          "Expected to have finished reduction in the prior iteration before starting a new one",
                          "a parameter that gets no gradient in an iteration (an unused branch, a frozen head)",
                          "fix the model, or find_unused_parameters=True (a graph walk every step), or "
                          "static_graph=True (when the same parameters are unused every time)"),
    "uneven-inputs": (uneven_inputs, GLOO_TIMEOUT,
                      "one rank has more batches: its extra backward all-reduces with nobody, until the timeout",
                      "the same number of batches on every rank (DistributedSampler pads), or "
                      "torch.distributed.algorithms.Join"),
    "inplace-buffers": (inplace_buffers, INPLACE,
                        "torch 2.11: 'one of the variables needed for gradient computation has been modified by "
                        "an inplace operation', because DDP copies rank 0's buffers in place before every forward "
                        "and an earlier forward's graph had saved them (frozen BatchNorm, two forwards before one "
                        "backward); torch 2.14.1 no longer fails here",
                        "on torch 2.11: one forward per backward (concatenate the inputs), or "
                        "DDP(..., broadcast_buffers=False) (forward_sync_buffers=False in torch 2.14)"),
    "different-models": (different_models, "appears not to match sizes of the same param in process 0",
                         "the ranks built different models (a rank-dependent config, a different checkpoint)",
                         "build the model the same way on every rank; DDP then copies rank 0's weights"),
    "no-process-group": (no_process_group,
                         "Default process group has not been initialized, please make sure to call "
                         "init_process_group",
                         "a collective, or DDP, before init_process_group",
                         "init_process_group first, in every process"),
    "after-destroy": (after_destroy, "Default process group has not been initialized",
                      "a collective after destroy_process_group (a last metric in a `finally`)",
                      "every collective before destroy_process_group, which comes last"),
    "racing-checkpoint": (racing_checkpoint, "torn checkpoint",
                          "every rank writes the same file at once: the pieces interleave into a torn file",
                          "rank 0 writes (through a temp file and a rename), a barrier, then everyone reads"),
    "eval-through-wrapper": (eval_through_wrapper, GLOO_TIMEOUT,
                             "a rank with no evaluation batch skips the buffer broadcast that the first no_grad "
                             "forward through DDP makes; the others' broadcast waits for it",
                             "evaluate through model.module (no hidden collective); uneven but non-empty "
                             "evaluation through the wrapper happens to work (shown in the fixed run)"),
}
# errors the course shows elsewhere, listed so that a search for the message finds its demo
ELSEWHERE = [
    ("Address already in use / EADDRINUSE", "a fixed MASTER_PORT taken by another job",
     "04_multinode_tcp (test_port_taken...), 02 README pitfalls"),
    ("An attempt has been made to start a new process before the current process has finished its bootstrapping",
     "mp.spawn without the __main__ guard", "02_ddp_spawn README, a test runs both versions"),
    ("unrecognized arguments: --local-rank=0", "the deprecated launcher and a script that knows only --local_rank",
     "03_ddp_torchrun README, From torch.distributed.launch to torchrun"),
    ("SyncBatchNorm layers only work with GPU modules", "nn.SyncBatchNorm on the CPU",
     "06_amp_syncbn: syncbn_by_hand.py"),
    ("Detected mismatch between collectives on ranks", "a collective only some ranks call",
     "05_collectives: make hang-demo"),
]


def run_case(name: str, variant: str) -> None:
    """One rank's part of one case."""
    rank = int(os.environ["RANK"])
    course.share_cpu_threads(int(os.environ["LOCAL_WORLD_SIZE"]))
    hangs = variant == "broken" and CASES[name][1] == GLOO_TIMEOUT
    if name != "no-process-group":
        dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT if hangs else PATIENT))
    try:
        CASES[name][0](rank, variant)
        if dist.is_initialized():
            dist.barrier()
    finally:
        workarounds.free_ddp_models()  # workaround: free DDP objects before the group goes, or exit can abort
        if dist.is_initialized():
            dist.destroy_process_group()


# --------------------------------------------------------------------------- the driver


class Launch:
    """One variant of one case: 2 processes with the environment torchrun gives its workers (RANK, WORLD_SIZE, ...).

    They are forked from this driver, which has already imported torch (a fresh interpreter per process would
    spend most of the gallery's time importing it); the driver itself never touches a process group or a GPU.
    """

    def __init__(self, name: str, variant: str, port: int):
        self.tmp = tempfile.TemporaryDirectory(prefix="gallery-")
        self.start, self.deadline = time.time(), time.time() + PATIENT + 3 * TIMEOUT
        self.logs, self.procs = [], []
        sys.stdout.flush()
        sys.stderr.flush()
        for rank in range(2):
            env = {"GALLERY_TMP": self.tmp.name, "TQDM_DISABLE": "1", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                   "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}  # 16 processes share the cores: 1 thread each
            log = open(Path(self.tmp.name) / f"rank{rank}.log", "w+")
            self.logs.append(log)
            pid = os.fork()
            if pid == 0:  # the worker: its own process group (to be stopped as a whole), output into its log
                os.setsid()
                os.dup2(log.fileno(), 1)
                os.dup2(log.fileno(), 2)
                os.environ.update(env)
                torch.set_num_threads(1)  # OMP_NUM_THREADS above; share_cpu_threads in run_case leaves it
                code = 1
                try:
                    run_case(name, variant)
                    code = 0
                except SystemExit as stop:
                    code = stop.code if isinstance(stop.code, int) else 1
                except BaseException:
                    traceback.print_exc()
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            self.procs.append(pid)
        self.codes = [None, None]
        self.code, self.failed_at = None, None

    def poll(self) -> bool:
        """True once finished. When one process fails, the other has a few seconds to end by itself (it mostly
        fails too, and may be the one that says why: its peer's error can be just "Connection closed by peer"),
        then it is stopped."""
        if self.code is not None:
            return True
        for i, pid in enumerate(self.procs):
            if self.codes[i] is None:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    self.codes[i] = os.waitstatus_to_exitcode(status)
        failed = [c for c in self.codes if c not in (None, 0)]
        now = time.time()
        if failed and self.failed_at is None:
            self.failed_at = now
        late = now > self.deadline
        if None not in self.codes or late or (failed and now > self.failed_at + GRACE):
            for i, pid in enumerate(self.procs):
                if self.codes[i] is None:
                    os.killpg(pid, 9)
                    self.codes[i] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            self.code = -9 if late and not failed else (failed[0] if failed else 0)
            self.seconds = time.time() - self.start
            self.output = "\n".join(f"[rank{r}] {ln}" for r, log in enumerate(self.logs)
                                    for ln in (log.seek(0) or log.read()).splitlines())
            if late:
                self.output += "\n(stopped by the driver's timeout)"
            for log in self.logs:
                log.close()
            self.tmp.cleanup()
        return self.code is not None


def wordings(message: str | tuple[str, ...]) -> tuple[str, ...]:
    return (message,) if isinstance(message, str) else message


def launch_both(name: str) -> tuple[Launch, Launch]:
    """The broken and the fixed variant of one case side by side."""
    return Launch(name, "broken", common.free_port()), Launch(name, "fixed", common.free_port())


def report(name: str, broken: Launch, fixed: Launch) -> bool:
    """Says what one case did; True when it behaved as described."""
    message = CASES[name][1]
    rc_b, out_b, sec_b = broken.code, broken.output, broken.seconds
    rc_f, out_f, sec_f = fixed.code, fixed.output, fixed.seconds
    if message is INPLACE and rc_b == 0:  # an error of older torch (2.11) that this one no longer raises
        quoted = "(none: runs in torch " + torch.__version__.split("+")[0] + ")"
        ok = rc_f == 0
        course.say(f"--- {name}: broken {'RAN (an error of older torch)' if rc_b == 0 else 'FAILED'} "
                   f"({sec_b:.0f} s), fixed {'ran' if rc_f == 0 else 'FAILED'} ({sec_f:.0f} s)")
    else:
        said = [ln.split(" ", 1)[1].strip() for ln in out_b.splitlines()
                if any(m in ln for m in wordings(message))]
        quoted = next((ln for ln in said if re.match(r"\w+(Error|Exception): ", ln)), said[0] if said else "")
        ok = rc_b != 0 and bool(quoted) and rc_f == 0
        course.say(f"--- {name}: broken "
                   f"{'failed as it should' if rc_b and quoted else 'DID NOT FAIL AS EXPECTED'}"
                   f" ({sec_b:.0f} s), fixed {'ran' if rc_f == 0 else 'FAILED'} ({sec_f:.0f} s)")
    course.say(f"    message: {_shorten(quoted or '(not found)')}")
    for line in (ln.split(" ", 1)[1] for ln in out_f.splitlines() if " " in ln):
        if line.startswith(("fixed", "Join", "forward_sync", "every rank", "all_reduce", "the all_reduce",
                            "rank 0 wrote", "uneven")):
            course.say(f"    fixed:   {line}")
    if not ok:
        course.say("    broken run's output ends:\n" + "\n".join(out_b.splitlines()[-15:]) if not quoted else
                   "    fixed run's output ends:\n" + "\n".join(out_f.splitlines()[-15:]))
    return ok


def main() -> int:
    parser = course.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated (default: all)")
    parser.add_argument("--case", choices=sorted(CASES), help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=("broken", "fixed"), help=argparse.SUPPRESS)
    course.accept_local_rank(parser)
    args = parser.parse_args()
    if args.case:  # a worker started by the driver
        run_case(args.case, args.variant)
        return 0
    names = [n for n in args.cases.split(",") if n]
    unknown = sorted(set(names) - set(CASES))
    if unknown or not names:
        parser.error(f"--cases: unknown {unknown or 'none given'}; choose from {', '.join(CASES)}")
    import torch._dynamo  # noqa: F401 - a DDP wrap imports it (about a second): once here, not in every forked rank

    # four cases at a time: while a timeout case waits out its seconds, the quick ones run
    waiting, running, finished, rows, failed = list(names), {}, {}, [], []
    while waiting or running:
        while waiting and len(running) < 4:
            name = waiting.pop(0)
            running[name] = launch_both(name)
        for name, (broken, fixed) in list(running.items()):
            if broken.poll() & fixed.poll():  # &, not and: poll both every time
                finished[name] = running.pop(name)
        while len(rows) < len(names) and names[len(rows)] in finished:
            name = names[len(rows)]
            broken, fixed = finished.pop(name)
            if not report(name, broken, fixed):
                failed.append(name)
            message = None if CASES[name][1] is INPLACE and broken.code == 0 else CASES[name][1]  # None: it ran
            rows.append((name, message, *CASES[name][2:], broken.seconds, fixed.seconds))
        time.sleep(0.05)
    course.say("\n| error | message | cause | fix | seconds (broken, fixed) |\n|---|---|---|---|---|")
    for name, message, cause, fix, sec_b, sec_f in rows:
        shown = (" or ".join(f"`{m}`" for m in wordings(message)) if message
                 else f"(runs in torch {torch.__version__.split('+')[0]})")
        course.say(f"| {name} | {shown} | {cause} | {fix} | {sec_b:.0f}, {sec_f:.0f} |")
    for message, cause, where in ELSEWHERE:
        course.say(f"| (elsewhere) | `{message}` | {cause} | see {where} | - |")
    course.say(f"\nresult: {len(rows) - len(failed)} of {len(rows)} cases behave as described"
               + (f"; NOT: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def _shorten(text: str, width: int = 160) -> str:
    text = re.sub(r"\s+", " ", text)
    return text if len(text) <= width else text[:width - 3] + "..."


if __name__ == "__main__":
    sys.exit(main())
