"""The error gallery: every case of error_cases.py run broken and fixed, its message checked, one table at the end.

    python 05_collectives/error_gallery.py                   # every case: broken, then fixed; a table at the end
    python 05_collectives/error_gallery.py --cases uneven-inputs,unused-parameters
    make errors

Each case runs twice, broken and fixed side by side, each as 2 processes on the CPU (Gloo) with the environment
torchrun gives its workers (RANK, WORLD_SIZE, MASTER_ADDR, ...; when one fails, the other has 3 s to end by
itself, then is stopped). The broken variant must fail with its message in error_cases.CASES (or hang until its
5 s process-group timeout), and the fixed variant must succeed. One case (inplace-buffers) is an error of torch
2.11 that 2.14.1 no longer raises: its broken variant may run or fail with that message. The gallery exits with 1
if any case does not behave so. Four cases run at a time (16 light processes, 1 thread each): the timeout cases
spend their seconds waiting; the report keeps the order of the cases.
"""

import argparse
import os
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from error_cases import CASES, INPLACE, PATIENT, TIMEOUT, run_case  # the cases: 05_collectives/error_cases.py

import common

GRACE = 3.0  # seconds a rank may still take to fail by itself after its peer failed

WHY = {  # name: (cause, fix), for the table at the end
    "unused-parameters": ("a parameter that gets no gradient in an iteration (an unused branch, a frozen head)",
                          "fix the model, or find_unused_parameters=True (a graph walk every step), or "
                          "static_graph=True (when the same parameters are unused every time)"),
    "uneven-inputs": ("one rank has more batches: its extra backward all-reduces with nobody, until the timeout",
                      "the same number of batches on every rank (DistributedSampler pads), or "
                      "torch.distributed.algorithms.Join"),
    "inplace-buffers": ("torch 2.11: 'one of the variables needed for gradient computation has been modified by "
                        "an inplace operation', because DDP copies rank 0's buffers in place before every forward "
                        "and an earlier forward's graph had saved them (frozen BatchNorm, two forwards before one "
                        "backward); torch 2.14.1 no longer fails here",
                        "on torch 2.11: one forward per backward (concatenate the inputs), or "
                        "DDP(..., broadcast_buffers=False) (forward_sync_buffers=False in torch 2.14)"),
    "different-models": ("the ranks built different models (a rank-dependent config, a different checkpoint)",
                         "build the model the same way on every rank; DDP then copies rank 0's weights"),
    "no-process-group": ("a collective, or DDP, before init_process_group",
                         "init_process_group first, in every process"),
    "after-destroy": ("a collective after destroy_process_group (a last metric in a `finally`)",
                      "every collective before destroy_process_group, which comes last"),
    "racing-checkpoint": ("every rank writes the same file at once: the pieces interleave into a torn file",
                          "rank 0 writes (through a temp file and a rename), a barrier, then everyone reads"),
    "eval-through-wrapper": ("a rank with no evaluation batch skips the buffer broadcast that the first no_grad "
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
                torch.set_num_threads(1)  # OMP_NUM_THREADS above, for this already started interpreter
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


def ended(launch: Launch) -> str:
    """How each rank of one variant ended: its exit code (-9: stopped by the driver) and the type of the last
    exception it printed, if any, e.g. "rank 0 exit 1 RuntimeError, rank 1 exit 0"."""
    said = []
    for rank, code in enumerate(launch.codes):
        lines = [ln.split(" ", 1)[1] for ln in launch.output.splitlines() if ln.startswith(f"[rank{rank}] ")]
        kinds = [m[1] for ln in lines if (m := re.match(r"([\w.]+(?:Error|Exception)): ", ln))]
        said.append(f"rank {rank} exit {code}" + (f" {kinds[-1]}" if kinds else ""))
    return ", ".join(said)


def report(name: str, broken: Launch, fixed: Launch) -> bool:
    """Says what one case did; True when it behaved as described."""
    message = CASES[name][1]
    rc_b, out_b, sec_b = broken.code, broken.output, broken.seconds
    rc_f, out_f, sec_f = fixed.code, fixed.output, fixed.seconds
    if message is INPLACE and rc_b == 0:  # an error of older torch (2.11) that this one no longer raises
        quoted = "(none: runs in torch " + torch.__version__.split("+")[0] + ")"
        ok = rc_f == 0
        print(f"--- {name}: broken {'RAN (an error of older torch)' if rc_b == 0 else 'FAILED'} "
              f"({sec_b:.0f} s), fixed {'ran' if rc_f == 0 else 'FAILED'} ({sec_f:.0f} s)")
    else:
        said = [ln.split(" ", 1)[1].strip() for ln in out_b.splitlines()
                if any(m in ln for m in wordings(message))]
        quoted = next((ln for ln in said if re.match(r"\w+(Error|Exception): ", ln)), said[0] if said else "")
        ok = rc_b != 0 and bool(quoted) and rc_f == 0
        print(f"--- {name}: broken "
              f"{'failed as it should' if rc_b and quoted else 'DID NOT FAIL AS EXPECTED'}"
              f" ({sec_b:.0f} s), fixed {'ran' if rc_f == 0 else 'FAILED'} ({sec_f:.0f} s)")
    print(f"    message: {_shorten(quoted or '(not found)')}")
    print(f"    ranks:   broken {ended(broken)}; fixed {ended(fixed)}")
    for line in (ln.split(" ", 1)[1] for ln in out_f.splitlines() if " " in ln):
        if line.startswith(("fixed", "Join", "forward_sync", "every rank", "all_reduce", "the all_reduce",
                            "rank 0 wrote", "uneven")):
            print(f"    fixed:   {line}")
    if not ok:
        print("    broken run's output ends:\n" + "\n".join(out_b.splitlines()[-15:]) if not quoted else
              "    fixed run's output ends:\n" + "\n".join(out_f.splitlines()[-15:]))
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated (default: all)")
    args = parser.parse_args()
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
            running[name] = Launch(name, "broken", common.free_port()), Launch(name, "fixed", common.free_port())
        for name, (broken, fixed) in list(running.items()):
            if broken.poll() & fixed.poll():  # &, not and: poll both every time
                finished[name] = running.pop(name)
        while len(rows) < len(names) and names[len(rows)] in finished:
            name = names[len(rows)]
            broken, fixed = finished.pop(name)
            if not report(name, broken, fixed):
                failed.append(name)
            message = None if CASES[name][1] is INPLACE and broken.code == 0 else CASES[name][1]  # None: it ran
            rows.append((name, message, *WHY[name], broken.seconds, fixed.seconds))
        time.sleep(0.05)
    print("\n| error | message | cause | fix | seconds (broken, fixed) |\n|---|---|---|---|---|")
    for name, message, cause, fix, sec_b, sec_f in rows:
        shown = (" or ".join(f"`{m}`" for m in wordings(message)) if message
                 else f"(runs in torch {torch.__version__.split('+')[0]})")
        print(f"| {name} | {shown} | {cause} | {fix} | {sec_b:.0f}, {sec_f:.0f} |")
    for message, cause, where in ELSEWHERE:
        print(f"| (elsewhere) | `{message}` | {cause} | see {where} | - |")
    print(f"\nresult: {len(rows) - len(failed)} of {len(rows)} cases behave as described"
          + (f"; NOT: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def _shorten(text: str, width: int = 160) -> str:
    text = re.sub(r"\s+", " ", text)
    return text if len(text) <= width else text[:width - 3] + "..."


if __name__ == "__main__":
    sys.exit(main())
