"""The numbers and pictures of ddp_timeline.py: the overlap figures, the lane added to each Chrome trace, the
table and the PNGs. ddp_timeline.py calls it; run by itself it redraws the PNGs from a timeline.json.

    python 02_ddp_spawn/timeline_report.py runs/timeline          # timeline_<model>.png from runs/timeline

Every time here is a host time (time.perf_counter, seconds) noted by ddp_timeline.py's hooks.
"""

import argparse
import json
import statistics
from pathlib import Path

LANE = 10_000_000  # the trace's thread id of the added lane


def add_lane(trace_path, steps, marks):
    """Put the hook's buckets and the compute phases into the profiler's trace, on the profiler's clock."""
    trace = json.loads(Path(trace_path).read_text())
    events = trace["traceEvents"]
    starts = step_marks(events)
    pid = starts["timeline step 0"]["pid"]
    added = [{"ph": "M", "name": "thread_name", "pid": pid, "tid": LANE,
              "args": {"name": "DDP timeline (compute phases, all-reduced buckets)"}}]
    for i, (step, mark) in enumerate(zip(steps, marks, strict=True)):
        offset = starts[f"timeline step {i}"]["ts"] - mark * 1e6  # profiler microseconds - our seconds
        for name, start, end, *compute_end in step["phases"]:
            added.append(_event(f"{name} (step {i})", start, end, offset, pid, "compute"))
            if compute_end:
                added.append(_event(f"backward compute (step {i})", start, compute_end[0], offset, pid, "compute"))
        for index, start, end, nbytes in step["buckets"]:
            added.append(_event(f"all-reduce bucket {index} (step {i})", start, end, offset, pid, "allreduce",
                                bytes=nbytes))
    trace["traceEvents"] = events + added
    Path(trace_path).write_text(json.dumps(trace))


def step_marks(events) -> dict:
    """The "timeline step N" ranges as the host recorded them, by name. On CUDA the profiler also writes a GPU-side
    copy of every record_function range (category gpu_user_annotation, on the GPU's own lane and clock); our
    marks are host times, so only the CPU-side one (user_annotation) gives the offset."""
    return {e["name"]: e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
            and e.get("name", "").startswith("timeline step ")}


def _event(name, start, end, offset, pid, cat, **extra):
    return {"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": LANE, "ts": start * 1e6 + offset,
            "dur": (end - start) * 1e6, "args": extra}


def summarize(steps):
    """Per step: total all-reduce time, the part of it hidden under backward's compute, what backward waited."""
    rows = []
    for step in steps:
        backward = [p for p in step["phases"] if p[0] == "backward"][-1]  # the one that communicates
        _, b_start, b_end, compute_end = backward
        comm = sum(end - start for _, start, end, _ in step["buckets"])
        hidden = sum(max(0.0, min(end, compute_end) - max(start, b_start)) for _, start, end, _ in step["buckets"])
        rows.append({"step_s": step["phases"][-1][2] - step["phases"][0][1], "allreduce_s": comm,
                     "hidden_share": hidden / comm if comm else 0.0, "backward_wait_s": b_end - compute_end,
                     "buckets": len(step["buckets"]),
                     "first_start_before_compute_end": bool(step["buckets"])
                     and step["buckets"][0][1] < compute_end})
    return rows


HOST_ONLY = ("allreduce_s", "hidden_share", "backward_wait_s", "first_start_before_compute_end_every_step")


def medians(every, device_type: str = "cpu") -> dict:
    """Medians over every rank's steps. On CUDA the host saw only when work was queued: the figures that need
    when an all-reduce ran (HOST_ONLY) are None there, not measured."""
    rows = [r for steps in every for r in summarize(steps)]
    med = {k: statistics.median(r[k] for r in rows) for k in ("step_s", "allreduce_s", "hidden_share",
                                                               "backward_wait_s")}
    med["buckets"] = rows[0]["buckets"]
    med["first_start_before_compute_end_every_step"] = all(r["first_start_before_compute_end"] for r in rows)
    if device_type == "cuda":
        med.update(dict.fromkeys(HOST_ONLY))
    return med


def describe(every, device_type: str = "cpu"):
    med = medians(every, device_type)
    if med["hidden_share"] is None:
        return (f"step {med['step_s'] * 1e3:7.1f} ms, {med['buckets']} bucket(s); all-reduce time and overlap not "
                f"measured on CUDA (the host sees when work is queued, not when it runs: read the trace's GPU lanes)")
    return (f"step {med['step_s'] * 1e3:7.1f} ms, {med['buckets']} bucket(s), all-reduce "
            f"{med['allreduce_s'] * 1e3:6.1f} ms of which {med['hidden_share']:4.0%} hidden under backward, "
            f"backward waited {med['backward_wait_s'] * 1e3:5.1f} ms after compute")


def write(out: Path, config: dict, results: dict) -> None:
    """timeline.json (the configuration, the medians, every rank's last profiled step), timeline.md, the PNGs."""
    summary = {"config": config, "results": {}, "lanes": {}}
    lines = [f"# DDP timeline: {config['world_size']} processes, {config['device']}, {config['backend']}", "",
             f"Median over {config['steps']} profiled steps x {config['world_size']} ranks, batch "
             f"{config['batch_size']} per rank.", "",
             "| model | variant | buckets | step ms | all-reduce ms | hidden under backward | backward waited ms |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for key, every in results.items():
        med = summary["results"][key] = medians(every, config["device"])
        summary["lanes"][key] = [steps[-1] for steps in every]
        timed = [f"{med['allreduce_s'] * 1e3:.1f}", f"{med['hidden_share']:.0%}", f"{med['backward_wait_s'] * 1e3:.1f}"
                 ] if med["hidden_share"] is not None else ["not measured on CUDA"] * 3
        lines.append(f"| {' | '.join(key.split('/'))} | {med['buckets']} | {med['step_s'] * 1e3:.1f} | "
                     + " | ".join(timed) + " |")
    (out / "timeline.json").write_text(json.dumps(summary, indent=1))
    (out / "timeline.md").write_text("\n".join(lines) + "\n")
    pngs = [draw(out, model, summary) for model in dict.fromkeys(key.split("/")[0] for key in results)]
    print("\n".join(lines) + f"\nwritten: {out / 'timeline.json'}, {out / 'timeline.md'}, "
          f"{', '.join(map(str, filter(None, pngs)))}", flush=True)


def draw(out, model_name, summary):
    try:
        import matplotlib
    except ImportError:
        print(f"no plot timeline_{model_name}.png: matplotlib is not installed here (the numbers are in timeline.json)",
              flush=True)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"forward": "#9ecae1", "backward": "#3182bd", "backward waits": "#bdbdbd", "optimizer": "#a1d99b",
              "all-reduce": "#e6550d"}
    variants = [key.split("/")[1] for key in summary["lanes"] if key.startswith(model_name + "/")]
    ranks = summary["config"]["world_size"]
    fig, axes = plt.subplots(1, len(variants), figsize=(6 * len(variants), 1.6 + 0.9 * ranks), squeeze=False)
    for ax, variant in zip(axes[0], variants, strict=True):
        every = summary["lanes"][f"{model_name}/{variant}"]  # every rank's last profiled step
        origin = min(step["phases"][0][1] for step in every)
        for rank, step in enumerate(every):
            y = 2 * (len(every) - 1 - rank)
            for name, start, end, *compute_end in step["phases"]:
                parts = [(name, start, end)] if not compute_end else \
                    [(name, start, compute_end[0]), ("backward waits", compute_end[0], end)]  # for the all-reduce
                for part, a, b in parts:
                    ax.barh(y + 1, (b - a) * 1e3, left=(a - origin) * 1e3, height=0.8, color=colors[part],
                            edgecolor="white", linewidth=0.5)
            for _, start, end, _ in step["buckets"]:
                ax.barh(y, (end - start) * 1e3, left=(start - origin) * 1e3, height=0.8, color=colors["all-reduce"],
                        edgecolor="black", linewidth=0.5)
        ax.set_yticks([v for r in range(len(every)) for v in (2 * r, 2 * r + 1)])
        ax.set_yticklabels([lab for r in reversed(range(len(every))) for lab in
                            (f"rank {r} all-reduce", f"rank {r} compute")], fontsize=8)
        med = summary["results"][f"{model_name}/{variant}"]
        ax.set_title(f"{variant}: {med['buckets']} bucket(s), " + (
            f"{med['hidden_share']:.0%} of all-reduce hidden" if med["hidden_share"] is not None
            else "times the host queued the work (CUDA), not when it ran"), fontsize=10)
        ax.set_xlabel("ms since the step began (last profiled step)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, list(colors), loc="upper right", ncol=len(colors), fontsize=8)
    fig.suptitle(f"DDP {model_name}: backward and the gradient all-reduce, per rank", x=0.25)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    path = out / f"timeline_{model_name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main():
    parser = argparse.ArgumentParser(description="Redraw the PNGs of a ddp_timeline.py run from its timeline.json.")
    parser.add_argument("folder", type=Path, help="the run's --output-dir (it holds timeline.json)")
    folder = parser.parse_args().folder
    summary = json.loads((folder / "timeline.json").read_text())
    for model in dict.fromkeys(key.split("/")[0] for key in summary["lanes"]):
        print(f"written: {draw(folder, model, summary)}")


if __name__ == "__main__":
    main()
