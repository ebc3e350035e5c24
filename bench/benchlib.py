"""What every benchmark script here shares: the machine description, statistics over rounds, the
result files (JSON + markdown + PNG, named by benchmark, backend, machine and date) and bar plots.

The rule all of them follow: every variant runs once per round, in an order that rotates from round
to round, so that a noisy moment of the machine hits all variants alike; ratios between variants are
computed inside each round and only then summarised over the rounds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

# `python bench/NAME.py` from the course's root, with an interpreter that has no install of the course: the root is
# not on sys.path (the script's folder is), so common and tools would not be found
if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from tools import course  # noqa: E402


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def make_parser(doc: str, quick_help: str) -> argparse.ArgumentParser:
    """The flags every benchmark has: --quick, --rounds, --output-dir; the module docstring as help."""
    first, _, rest = doc.partition("\n\n")  # the first paragraph, then the rest as written
    parser = argparse.ArgumentParser(description=first, epilog=rest,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=quick_help + ": a smoke run, not a measurement")
    parser.add_argument("--rounds", type=positive_int, default=5, help="rounds of every variant (default %(default)s)")
    parser.add_argument("--output-dir", default="bench/results", help="where results go (default %(default)s)")
    return parser


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags(wanted=("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")) -> list[str]:
    """The CPU features that decide how fast fp32, bf16 and fp16 can be (Linux; empty elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in wanted if f in have]
    except OSError:
        pass
    return []


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def machine_info(device: torch.device, backend: str | None = None) -> dict:
    cuda = device.type == "cuda"
    return {"cpu": cpu_model(), "cpu_flags": cpu_flags(), "cores": usable_cores(),
            "gpu": torch.cuda.get_device_name(device) if cuda else None,
            "gpus": torch.cuda.device_count() if cuda else 0, "torch": torch.__version__,
            "cuda": torch.version.cuda if cuda else None, "backend": backend, "device": device.type,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M")}


def machine_tag(device: torch.device) -> str:
    """A short name for file names: 'cpu2' (2 cores) or the GPU's model, such as 'h100'."""
    if device.type == "cuda":
        words = torch.cuda.get_device_name(device).lower().split()
        model = next((w for w in words if re.search(r"[a-z]", w) and re.search(r"\d", w)), words[-1])
        return re.sub(r"[^a-z0-9]+", "", model) or "gpu"
    return f"cpu{usable_cores()}"


def stem(name: str, device: torch.device, backend: str | None, quick: bool) -> str:
    parts = [name] + ([backend] if backend else []) + [machine_tag(device)] + (["quick"] if quick else [])
    return "_".join(parts + [time.strftime("%Y-%m-%d")])


def summarize(values) -> dict:
    """Median over rounds, the smallest and largest value, and the spread (max - min) / median."""
    values = [float(v) for v in values]
    med = statistics.median(values)
    return {"median": med, "min": min(values), "max": max(values),
            "spread": (max(values) - min(values)) / med if med else 0.0, "rounds": len(values)}


def rotated(items: list, round_index: int) -> list:
    """The round's order: round r starts with item r, so no variant always runs first or last."""
    k = round_index % len(items) if items else 0
    return items[k:] + items[:k]


def run_rounds(variants: dict, rounds: int, say=course.say) -> list[dict]:
    """Run every variant once per round, in the rotated order; print each round's images/s.

    `variants` maps a name to a function returning a dict with at least 'images_per_s'. Returns one
    {name: that dict} per round, so that ratios can be taken inside a round.
    """
    per_round = []
    for r in range(rounds):
        results = {name: variants[name]() for name in rotated(list(variants), r)}
        per_round.append(results)
        say(f"round {r + 1}/{rounds}: " + ", ".join(f"{k} {v['images_per_s']:.4g}" for k, v in results.items()))
    return per_round


def column(per_round: list[dict], key: str = "images_per_s") -> list[dict]:
    """One number per variant and round: [{name: result[key]}, ...] (variants without it are left out)."""
    return [{name: result[key] for name, result in r.items() if key in result} for r in per_round]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step, warmup: int, steps: int, device: torch.device) -> tuple[int, float]:
    """Run `step` (returns the images it processed) warmup times untimed, then steps times timed.

    Returns (images, seconds). In a process group of more than one, all ranks start the clock together.
    """
    import torch.distributed as dist

    for _ in range(warmup):
        step()
    sync(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    start = time.perf_counter()
    images = sum(step() for _ in range(steps))
    sync(device)
    return images, time.perf_counter() - start


def md_table(headers: list[str], rows: list[list]) -> list[str]:
    align = ["---"] + ["---:"] * (len(headers) - 1)
    return ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"] + [
        "| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def fmt_range(s: dict, digits: int = 0, pct: bool = False) -> str:
    """'1234 (1200-1300)' or '+3.1 % (-1.0 .. +5.2)': the median with the range over rounds."""
    if pct:
        return f"{s['median']:+.1%} ({s['min']:+.1%} .. {s['max']:+.1%})".replace("%", " %")
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def check_finite(obj, where: str = "result") -> None:
    """Refuse to write a result with NaN or infinite numbers in it (a broken measurement)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            check_finite(v, f"{where}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            check_finite(v, f"{where}[{i}]")
    elif isinstance(obj, float) and not math.isfinite(obj):
        raise ValueError(f"{where} is {obj}: the measurement went wrong")


def write_results(out_dir, name: str, payload: dict, md_lines: list[str]) -> list[Path]:
    """Write NAME.json and NAME.md atomically; return their paths. A quick run's table says what it is."""
    check_finite(payload)
    if payload.get("quick"):
        md_lines = md_lines[:1] + ["", "> Quick run (`--quick`): tiny sizes and few steps, to check that the benchmark "
                                       "runs. Do not read speeds from it."] + md_lines[1:]
    out = Path(out_dir)
    paths = [course.atomic_write_bytes((json.dumps(payload, indent=1) + "\n").encode(), out / f"{name}.json"),
             course.atomic_write_bytes(("\n".join(md_lines) + "\n").encode(), out / f"{name}.md")]
    return paths


def no_plot_line(png) -> str:
    """The one line a benchmark prints instead of drawing `png` where matplotlib is missing."""
    png = Path(png)
    return f"no plot {png.name}: matplotlib is not installed here (the numbers are in {png.with_suffix('.json').name})"


def pyplot(png):
    """matplotlib's pyplot without a display, or None if matplotlib is not installed (saying so, in one line)."""
    try:
        import matplotlib
    except ImportError:
        print(no_plot_line(png), flush=True)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def bar_plot(path, labels: list[str], summaries: list[dict], ylabel: str, title: str, colors=None,
             hline: float | None = None, hline_label: str = "") -> Path | None:
    """Bars at the median, whiskers from the smallest to the largest round, and an optional reference line."""
    plt = pyplot(path)
    if plt is None:
        return None
    meds = [s["median"] for s in summaries]
    err = [[m - s["min"] for m, s in zip(meds, summaries, strict=True)],
           [s["max"] - m for m, s in zip(meds, summaries, strict=True)]]
    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(labels) + 2), 4))
    ax.bar(range(len(labels)), meds, yerr=err, capsize=4, color=colors or "tab:blue")
    if hline is not None:
        ax.axhline(hline, color="gray", linestyle="--", linewidth=1, label=hline_label or None)
        if hline_label:
            ax.legend(fontsize=8)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    for i, (m, s) in enumerate(zip(meds, summaries, strict=True)):
        ax.annotate(f"{m:.0f}" if m >= 100 else f"{m:.3g}", (i, s["max"]), ha="center", va="bottom", fontsize=7,
                    xytext=(0, 2), textcoords="offset points")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def run_bounded(cmd: list[str], timeout: float, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    """Run a launcher in its own session; on timeout kill that session (only what it started)."""
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        raise RuntimeError(f"{' '.join(cmd)} took longer than {timeout:.0f} s and was stopped:\n"
                           f"{out[-3000:]}") from None
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{out[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")
