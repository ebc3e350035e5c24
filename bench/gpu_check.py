"""The course on this machine's GPUs: the GPU tests, every make target on CUDA, and the figures a reader wants.

    python bench/gpu_check.py                  # everything that fits this machine (about 15 minutes on one GPU)
    python bench/gpu_check.py --list           # what would run here, and what not (and why)
    python bench/gpu_check.py --only smoke,ddp-torchrun
    make gpu-check

What runs depends on the GPUs visible:
- the pytest tests marked `cuda` (one GPU) and `multigpu` (two or more);
- every make target once, on CUDA: with NCCL where there is a GPU for every process (NPROC = the GPU count),
  with processes sharing the GPU through Gloo where there is only one (NPROC=2 --device cuda --backend gloo);
  demos that need more GPUs than there are say so in their row ("needs 2 GPUs") and run on the CPU;
- the benchmarks that give the figures: MNIST on one GPU (epoch time, accuracy; the MNIST goals are judged only
  on real MNIST, which `--dataset auto` takes when it is in data/ or can be downloaded), ResNet-18 images/s in fp32
  (TF32 off), TF32, bf16 and fp16, DDP's cost at world size 1, DataParallel on one GPU, and all_reduce bus
  bandwidth where there are 2 GPUs or more.

Writes bench/results/gpu_check_<gpu>_<date>.{json,md} (per step: passed or not, seconds, a note) and, for every
failed step, its output in gpu_check_<gpu>_<date>_logs/. Exit code 1 if any step failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import benchlib
from tools import course

REPO = Path(__file__).resolve().parents[1]
GOALS = {"mnist_test_acc": 0.98, "mnist_epoch_s": 2.0, "resnet18_bf16_vs_fp32": 2.0}


@dataclass
class Step:
    name: str
    cmd: list[str]
    timeout: float = 300
    note: str = ""
    skip: str = ""  # why it does not run here ("" = it runs)
    env: dict = field(default_factory=dict)


def make(target: str, **variables) -> list[str]:
    return ["make", "--no-print-directory", target] + [f"{k}={v}" for k, v in variables.items() if v is not None]


def can_make_netns() -> bool:
    """Root alone is not enough: a container without CAP_SYS_ADMIN (a typical rented GPU) refuses `ip netns add`."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        return False
    name = f"ddp-probe-{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode != 0:
        return False
    subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    return True


def plan(gpus: int, is_root: bool = True, bench_out: str = "bench/results") -> list[Step]:
    """Every step for a machine with `gpus` GPUs, in order. Pure: tests call it with any GPU count."""
    if gpus < 1:
        return []
    many = gpus >= 2
    # several processes: one GPU each with NCCL, or two sharing the one GPU through Gloo
    nproc = gpus if many else 2
    share = None if many else "--device cuda --backend gloo"
    shared_note = "" if many else "2 processes share the GPU through Gloo (NCCL needs 2 GPUs)"
    cpu_note = "" if many else "runs on the CPU with Gloo: its NCCL path needs 2 GPUs"
    short = "--max-steps 30"
    nodes_proc = max(1, gpus // 2)
    steps = [
        Step("pytest cuda/multigpu", [sys.executable, "-m", "pytest", "-m", "cuda or multigpu", "tests", "-q",
                                      "-p", "no:cacheprovider"], timeout=1200,
             note="" if many else "multigpu tests are skipped: they need 2 GPUs"),
        Step("smoke", make("smoke", DATASET="auto", ARGS="--epochs 2"),
             note="MNIST on one GPU: the figures below (the goals need real MNIST, not the stand-in)"),
        Step("dataparallel", make("dataparallel", EPOCHS=1),
             note=f"nn.DataParallel over {gpus} GPU(s)" + ("" if many else ": one GPU, nothing to split")),
        Step("dp-shapes", make("dp-shapes"), note="" if many else "one GPU: the split for 2 is shown, not run"),
        # model parallelism wants 2 GPUs per process: with fewer than 4 its halves run on the CPU, which
        # --device cuda (the processes sharing one GPU) would refuse, so on 1 GPU it is a step of its own
        Step("ddp-basics", make("ddp-basics", NPROC=gpus // 2 if gpus >= 4 else nproc, ARGS=share,
                                DEMOS=None if many else "basic checkpoint process"),
             note="; ".join(n for n in (shared_note, "" if gpus >= 4 else
                                        "model parallel needs 4 GPUs: its halves run on the CPU") if n)),
        *([] if many else [Step("ddp-basics model-parallel", make("ddp-basics", NPROC=2, DEMOS="model-parallel"),
                                note="model parallel needs 4 GPUs: its halves run on the CPU")]),
        Step("ddp-equivalence", make("ddp-equivalence", NPROC=2), note="CPU by design (arithmetic)"),
        Step("ddp-spawn", make("ddp-spawn", NPROC=nproc, EPOCHS=1, ARGS=share), note=shared_note),
        Step("ddp-timeline", make("ddp-timeline", NPROC=nproc, ARGS=f"--output-dir {bench_out}/timeline_gpu "
                                  f"{share or ''}"), note=shared_note),
        Step("ddp-torchrun", make("ddp-torchrun", NPROC=nproc, ARGS=share), note=shared_note),
        Step("ddp-torchrun NPROC=1", make("ddp-torchrun", NPROC=1, EPOCHS=1), note="NCCL at world size 1"),
        Step("init-check", make("init-check", NPROC=nproc, ARGS=share), note=shared_note),
        Step("ddp-minimal", make("ddp-minimal", NPROC=gpus if many else 1)),
        Step("elastic-restart", make("elastic-restart", NPROC=nproc, FAIL_AT=40,
                                     ARGS=f"--epochs 2 {short} {share or ''}"), note=shared_note),
        Step("elastic-stress", make("elastic-stress", NPROC=nproc, RUNS=3, BENCH_OUT=bench_out),
             timeout=1200, note="3 runs with and 3 without the workaround"),
        Step("exit-stress", make("exit-stress", RUNS=3, BENCH_OUT=bench_out), timeout=600,
             note="Gloo on the CPU by design: the abort is in Gloo's teardown"),
        Step("launch-legacy", make("launch-legacy", NPROC=nproc, EPOCHS=1, ARGS=f"{short} {share or ''}"),
             note=shared_note),
    ]
    for target in ("multinode-tcp", "multinode-file", "multinode-torchrun"):
        steps.append(Step(target, make(target, NNODES=2, NPROC=nodes_proc, EPOCHS=1, ARGS=short),
                          note="" if many else "2 nodes need 2 GPUs: the launcher runs them on the CPU"))
    steps.append(Step("multinode-spawn", make("multinode-spawn", PROCS="2,1" if gpus >= 3 else "1,1"),
                      note="" if gpus >= 2 else "2 machines need 2 GPUs: they run on the CPU"))
    steps.append(Step("multinode-netns", make("multinode-netns", NPROC=nodes_proc, EPOCHS=1, ARGS=short),
                      skip="" if is_root else "needs root allowed to create network namespaces",
                      note="" if many else "2 hosts need 2 GPUs: they run on the CPU"))
    for target in ("collectives", "p2p", "ddp-from-scratch", "hang-demo"):
        steps.append(Step(target, make(target, NPROC=nproc), note=cpu_note))
    steps.append(Step("errors", make("errors"), note="Gloo on the CPU by design (the messages are Gloo's)"))
    steps += [
        Step("backend-matrix", make("backend-matrix", ARGS=f"--output-dir {bench_out}"), note=cpu_note),
        Step("ddp-eval", make("ddp-eval", NPROC=3), note="Gloo on the CPU by design (counting)"),
        Step("amp-syncbn", make("amp-syncbn", NPROC=nproc, EPOCHS=1, ARGS=share), note=shared_note),
        Step("syncbn-proof", make("syncbn-proof", NPROC=2), note="CPU by design (arithmetic)"),
        Step("grad-accum", make("grad-accum", NPROC=2), note="CPU by design (arithmetic)"),
        Step("cifar-resnet", make("cifar-resnet", NPROC=nproc, ARGS=share), note=shared_note),
        Step("bench-amp", make("bench-amp", BENCH_OUT=bench_out), timeout=900),
        Step("bench-throughput", make("bench-throughput", BENCH_OUT=bench_out), timeout=900),
        Step("bench-allreduce", make("bench-allreduce", NPROC=gpus, BENCH_OUT=bench_out), timeout=900,
             skip="" if many else "not run: needs 2 GPUs"),
        Step("bench-buckets", make("bench-buckets", NPROC=gpus, BENCH_OUT=bench_out), timeout=900,
             skip="" if many else "not run: needs 2 GPUs"),
        Step("bench-hooks", make("bench-hooks", NPROC=gpus, BENCH_OUT=bench_out), timeout=900,
             skip="" if many else "not run: needs 2 GPUs"),
    ]
    return steps


def run_step(step: Step, log_dir: Path) -> dict:
    """Run one step in its own session, bounded by its timeout; keep its output only if it failed."""
    start = time.time()
    try:
        out = benchlib.run_bounded(step.cmd, timeout=step.timeout, env={"TQDM_DISABLE": "1", **step.env}).stdout
        ok, log = True, None
    except RuntimeError as err:
        out, ok = str(err), False
        log = log_dir / (step.name.replace(" ", "_").replace("/", "-") + ".log")
        course.atomic_write_bytes(out.encode(), log)
    return {"step": step.name, "passed": ok, "seconds": round(time.time() - start, 1), "note": step.note,
            "command": " ".join(step.cmd), "log": str(log) if log else None, "final": _final(out)}


def _final(text: str) -> dict:
    """The last `final:` line of a step's output, as a dict of strings."""
    lines = [ln for ln in text.splitlines() if ln.startswith("final: ")]
    return dict(p.split("=", 1) for p in lines[-1][len("final: "):].split() if "=" in p) if lines else {}


def newest(out_dir: Path, prefix: str, since: float) -> dict | None:
    """The newest results JSON named prefix_* written after `since`."""
    found = [p for p in out_dir.glob(f"{prefix}_*.json") if p.stat().st_mtime >= since and "_quick_" not in p.name]
    return json.loads(max(found, key=lambda p: p.stat().st_mtime).read_text()) if found else None


def figures(rows: list[dict], out_dir: Path, since: float, gpus: int) -> dict:
    """The GPU figures a reader wants, from the steps' final lines and the benchmarks' results."""
    fig = {}
    single = next((r for r in rows if r["step"] == "smoke" and r["passed"]), None)
    if single and single["final"]:
        f = single["final"]
        fig["mnist_one_gpu"] = {"dataset": f["dataset"], "epochs": int(f["epochs"]),
                                "test_acc": float(f["test_acc"]),
                                "seconds_per_epoch": float(f["seconds"]) / int(f["epochs"])}
    amp = newest(out_dir, "amp", since)
    if amp:
        fig["resnet18_images_per_s"] = {p: amp["results"][f"resnet18/{p}"]["median"]
                                        for p in ("fp32", "tf32", "bf16", "fp16") if f"resnet18/{p}" in amp["results"]}
        fig["resnet18_vs_fp32"] = {k.split("/")[1].replace("_vs_fp32", ""): v["median"]
                                   for k, v in amp["ratios"].items() if k.startswith("resnet18/")}
    throughput = newest(out_dir, "throughput", since)
    if throughput:
        fig["ddp_ws1_overhead"] = throughput["ratios"]["ddp_ws1_overhead"]["median"]
        fig["dataparallel_vs_plain"] = throughput["ratios"]["dataparallel_vs_plain"]["median"]
    sweep = newest(out_dir, "allreduce_sweep", since)
    if sweep:
        fig["all_reduce_busbw_GBps"] = max(r["busbw_GBps"] for r in sweep["rows"] if r["op"] == "all_reduce")
    elif gpus < 2:
        fig["all_reduce_busbw_GBps"] = "not run: needs 2 GPUs"
    return fig


def goals(fig: dict) -> dict:
    """The course's GPU goals, met or not (None: not measured). The MNIST goals are about real MNIST: a run on
    the stand-in (no MNIST in data/ and no internet) leaves them unmeasured."""
    mnist = fig.get("mnist_one_gpu")
    mnist = mnist if mnist and mnist["dataset"] == "mnist" else None
    ratio = fig.get("resnet18_vs_fp32", {}).get("bf16")
    return {"mnist_test_acc >= 0.98": None if not mnist else mnist["test_acc"] >= GOALS["mnist_test_acc"],
            "mnist_epoch_s < 2": None if not mnist else mnist["seconds_per_epoch"] < GOALS["mnist_epoch_s"],
            "resnet18 bf16 >= 2x fp32": None if ratio is None else ratio >= GOALS["resnet18_bf16_vs_fp32"]}


def report(rows, fig, met, machine, out_dir: Path, name: str) -> list[Path]:
    md = [f"# GPU check: {machine['gpus']} x {machine['gpu']}", "",
          f"torch {machine['torch']}, CUDA {machine['cuda']}, {machine['cores']} CPU cores, {machine['date']}.", ""]
    md += benchlib.md_table(["step", "result", "seconds", "note"],
                            [[r["step"], "passed" if r["passed"] else ("not run" if r.get("skipped") else "FAILED"),
                              f"{r['seconds']:.0f}", r["note"] or r.get("skipped") or ""] for r in rows])
    md += ["", "Figures:", ""]
    md += benchlib.md_table(["figure", "value"], [[k, json.dumps(v)] for k, v in fig.items()])
    md += ["", "Goals:", ""]
    md += benchlib.md_table(["goal", "met"], [[k, {True: "yes", False: "no", None: "not measured"}[v]]
                                               for k, v in met.items()])
    payload = {"bench": "gpu_check", "machine": machine, "steps": rows, "figures": fig, "goals": met}
    return benchlib.write_results(out_dir, name, payload, md)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[2:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default="bench/results", help="where results go (default %(default)s)")
    parser.add_argument("--only", default="", help="comma-separated step names (default: all)")
    parser.add_argument("--list", action="store_true", help="print the plan for this machine and stop")
    parser.add_argument("--gpus", type=course.positive_int, help="with --list: the plan for a machine with N GPUs")
    args = parser.parse_args(argv)
    if args.gpus and not args.list:
        parser.error("--gpus only goes with --list: a real check uses the GPUs that are here")
    gpus = args.gpus or course.gpu_count()
    if gpus == 0:
        parser.exit(2, "error: gpu-check needs a CUDA GPU, and torch sees none here (torch.cuda.is_available() is "
                       "False). `--list --gpus 1` shows what it would run.\n")
    out_dir = Path(args.output_dir).resolve()
    os.chdir(REPO)  # every step is a command of the course, run from its root
    steps = plan(gpus, is_root=can_make_netns(), bench_out=str(out_dir))
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {s.name for s in steps}
        if unknown:
            parser.error(f"--only: unknown step(s) {sorted(unknown)}; --list shows them")
        steps = [s for s in steps if s.name in wanted]
    if args.list:
        for s in steps:
            note = f"   [{s.note}]" if s.note and not s.skip else ""
            course.say(f"{s.name:<22} {s.skip or ' '.join(s.cmd)}{note}")
        return 0

    import torch

    device = torch.device("cuda", 0)
    machine = benchlib.machine_info(device, "nccl" if gpus >= 2 else None)
    name = benchlib.stem("gpu_check", device, None, quick=False)
    log_dir = out_dir / f"{name}_logs"
    since, rows = time.time(), []
    for i, step in enumerate(steps, 1):
        if step.skip:
            rows.append({"step": step.name, "passed": False, "skipped": step.skip, "seconds": 0.0, "note": step.note,
                         "command": " ".join(step.cmd), "log": None, "final": {}})
            course.say(f"[{i}/{len(steps)}] {step.name}: {step.skip}")
            continue
        row = run_step(step, log_dir)
        rows.append(row)
        course.say(f"[{i}/{len(steps)}] {step.name}: {'passed' if row['passed'] else 'FAILED'} "
                   f"in {row['seconds']:.0f} s" + (f" (log: {row['log']})" if row["log"] else ""))
    fig = figures(rows, out_dir, since, gpus)
    met = goals(fig)
    paths = report(rows, fig, met, machine, out_dir, name)
    failed = [r["step"] for r in rows if not r["passed"] and not r.get("skipped")]
    course.say(f"{len(rows) - len(failed)} of {len(rows)} steps passed or were not for this machine; "
               f"failed: {', '.join(failed) or 'none'}. Written: {', '.join(map(str, paths))}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
