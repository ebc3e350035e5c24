"""Helpers for the notebooks: run a course command and fail the cell if it fails; show a script's own lines.

Notebooks never use `!cmd` (a failing `!cmd` does not fail its cell) nor mp.spawn of a function defined in a
cell (the child processes cannot import it). They call run() instead. The code they show is read from the
scripts when the notebook runs, so it cannot drift from what runs.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

REPO = next(p for p in [Path.cwd(), *Path.cwd().parents] if (p / "common.py").exists())
PYTHON = sys.executable
sys.path.insert(0, str(REPO))

from tools.lines import parse_lines  # noqa: E402 - without torch: the kernel imports it only if a cell needs it


def run(cmd, timeout: float = 600, quiet: bool = False, env: dict | None = None, trace=None) -> str:
    """Run `cmd` (a list, or a string split like a shell would) from the repo root.

    Prints its standard output (unless quiet) and returns it; raises with the tail of the
    error output if the command fails, so the cell fails too. With trace=DIR the course's tracer watches
    every process of the run (tools/tracer.py): read it with checks(DIR) and shards(DIR).
    """
    if trace is not None:
        path = os.pathsep.join(filter(None, [str(REPO / "tools" / "trace"), str(REPO), os.environ.get("PYTHONPATH")]))
        env = {**(env or {}), "COURSE_TRACE": str(trace), "PYTHONPATH": path}
    if isinstance(cmd, str):
        cmd = shlex.split(cmd)
    cmd = [PYTHON if c == "python" else str(c) for c in cmd]
    full_env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    if not quiet:
        print(proc.stdout, end="")
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.stdout


def final(output: str) -> dict:
    """The `final:` summary line of a run, as a dict (numbers converted)."""
    return parse_lines(output, "final")[-1]


def records(output: str, kind: str) -> list[dict]:
    """Every `kind: key=value ...` line of a run (kind: step, final), as dicts. kind "epoch" reads the
    `epoch E/N: key=value ...` lines, with E as "epoch"."""
    if kind == "epoch":
        return [{"epoch": int(m[1]), **parse_lines(f"epoch: {m[2]}", "epoch")[0]}
                for m in re.finditer(r"^epoch (\d+)/\d+: (.*)$", output, re.MULTILINE)]
    return parse_lines(output, kind)


def show(script: str, *names: str, marked: str = "") -> None:
    """Print lines of a course script with their line numbers: the named functions, and every statement that
    carries (or follows) a comment starting with `marked`, such as "DDP:"."""
    path = REPO / script
    text = path.read_text()
    lines = text.splitlines()
    spans = []
    statements = []  # (first line, last line, is compound) of every statement below the functions
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            if node.name in names:
                spans.append((min([node.lineno] + [d.lineno for d in node.decorator_list]), node.end_lineno))
        elif isinstance(node, ast.stmt):
            body = getattr(node, "body", None)
            compound = isinstance(body, list) and body and isinstance(body[0], ast.stmt)
            small = compound and node.end_lineno - node.lineno <= 3
            statements.append((node.lineno, node.end_lineno if small or not compound else body[0].lineno - 1))
    for number, line in enumerate(lines, 1) if marked else ():
        if f"# {marked}" not in line:
            continue
        owner = [span for span in statements if span[0] <= number <= span[1]]
        if line.strip().startswith("#"):  # a comment: it, the comment lines after it, and the statement after them
            after = [span for span in statements if span[0] > number]
            spans += [(number, min(after)[0] - 1 if after else number)] + ([min(after)] if after else [])
        elif owner:
            spans.append(min(owner, key=lambda span: span[1] - span[0]))
    shown, previous = set(), None
    print(f"# {script}")
    for start, end in sorted(spans):
        for number in range(start, end + 1):
            if number in shown:
                continue
            if previous is not None and number > previous + 1:
                print("    ...")
            print(f"{number:4d}  {lines[number - 1]}")
            shown.add(number)
            previous = number


def checks(trace_dir) -> dict:
    """The trace checks of a traced run (tools/tracecheck.py): {name: (verdict, message)}."""
    from tools import tracecheck

    return {c.name: (c.verdict, c.message) for c in tracecheck.judge(trace_dir)}


def shards(trace_dir) -> list[dict]:
    """What each rank trained on, epoch by epoch: rank, epoch, samples and the first 5 indices, from the trace."""
    from tools import tracecheck

    rows = []
    for rank, events in sorted(tracecheck.load(trace_dir).items()):
        passes = [e for e in events if e["ev"] == "loader" and e["train"]]
        rows += [{"rank": rank, "epoch": n + 1, "samples": len(p["indices"]), "first": p["indices"][:5]}
                 for n, p in enumerate(passes)]
    return rows
