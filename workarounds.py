"""Workarounds the benchmarks call: each one named, with what it fixes, when it is needed, and what it costs.

bench/throughput.py, bench/buckets.py and bench/comm_hooks.py call them where the problem can occur.
COURSE_WORKAROUNDS=off in the environment switches every one of them off. No script in a numbered folder imports
this module: where one needs the same fix (gc.collect() before destroy_process_group()), it makes the call
itself, with a comment that says why. How often a finished job aborts without that collection is recorded by
`make free-stress` (bench/results/stress_free_*).
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import sys


def enabled() -> bool:
    return os.environ.get("COURSE_WORKAROUNDS", "on") != "off"


def free_ddp_models() -> None:
    """Collect the garbage before destroy_process_group(), so that DDP wrappers are freed while the group exists.

    Fixes: a DDP model sits in reference cycles; if the cycle collector frees it during interpreter shutdown,
    after the group is gone, the process aborts. Needed: in the `finally` that destroys the group of any script
    that built a DDP model. Costs: one full garbage collection (milliseconds).
    """
    if enabled():
        gc.collect()


def stop_with_launcher() -> None:
    """Ask Linux to send this process SIGTERM when its launcher dies (prctl PR_SET_PDEATHSIG).

    Fixes: a launcher killed with SIGKILL (torchrun, mp.spawn's parent, a launch script) cannot stop its
    workers; they train on alone to the end, holding ports, GPUs and files. Needed: in a worker whose launcher
    can be killed so, as benchlib.run_bounded kills a benchmark that runs past its limit. Costs: nothing; on
    systems other than Linux it does nothing. A worker whose launcher is already gone stops at once.
    """
    if not enabled() or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)
