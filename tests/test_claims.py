"""CLAIMS.md: every claim of the course with a proof that exists, and numbers that equal their records.

The table's grammar (one row per claim):

    | id | claim | stated in | kind | runs on | proof |

- stated in: the files that make the claim, comma-separated.
- kind: behaviour, measurement, repeated (a repeated-run rate), external (PyTorch's own behaviour, a doc link),
  sample (an illustrative output).
- runs on: CPU (the proof runs in `make test` on a CPU-only machine), GPU, root, or - (no test: a record or link).
- proof: items in backticks:
    `tests/FILE.py::TEST` or `tests/FILE.py::TEST[PARAM]`      a test that must be collected
    `notebooks/NAME.ipynb::Cell N`                            a notebook cell that nbval runs
    `bench/results/FILE.json#KEY/KEY/KEY = VALUE`            a recorded number (a KEY of digits indexes a list);
                                                               VALUE is the number as the prose
                                                               writes it (its digits set the rounding; a trailing %
                                                               means the record is a fraction); VALUE must stand as
                                                               a whole number in a sentence (or a table row) of the
                                                               first stated-in file and of every other README the row
                                                               names, sharing two content words with the claim
    `https://...`                                             a documentation page
    `sample: COMMAND`                                         the command whose output the sample shows
"""

import importlib.util
import json
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
KINDS = {"behaviour", "measurement", "repeated", "external", "sample"}
RUNS_ON = {"CPU", "GPU", "root", "-"}


def rows(text: str | None = None) -> list[dict]:
    text = (REPO / "CLAIMS.md").read_text() if text is None else text
    found = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) != 6 or cells[0] in ("id", "") or set(cells[0]) <= set("-: "):
            continue
        found.append(dict(zip(("id", "claim", "stated", "kind", "runs_on", "proof"), cells, strict=True)))
    return found


def items(proof: str) -> list[str]:
    return re.findall(r"`([^`]+)`", proof)


COLLECT = r"""
import sys, pytest
class NeedsGpu:
    def pytest_collection_finish(self, session):
        for item in session.items:
            print("COLLECTED", item.nodeid, any(item.get_closest_marker(m) for m in ("cuda", "multigpu")))
sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests"], plugins=[NeedsGpu()]))
"""


@cache
def collected() -> dict[str, bool]:
    """Every test pytest collects: node id -> whether it needs a GPU (marked cuda or multigpu).

    What this session collected when it holds every test file (make test), else a collection of its own.
    """
    import harness

    files = {f"tests/{p.name}" for p in (REPO / "tests").glob("test_*.py")}
    if files <= {node.split("::")[0] for node in harness.COLLECTED}:
        return dict(harness.COLLECTED)
    out = subprocess.run([sys.executable, "-c", COLLECT], cwd=REPO, capture_output=True, text=True, timeout=120).stdout
    rows = [line[len("COLLECTED "):].rsplit(" ", 1) for line in out.splitlines() if line.startswith("COLLECTED ")]
    return {node: gpu == "True" for node, gpu in rows}


def json_value(path: str):
    """The value at `FILE#KEY/KEY`, or a sum and difference of such values in one record (`FILE#A - B`): a
    number the prose derives, such as "failed in 4 of 5 runs" from the runs and the passes."""
    file, _, expression = path.partition("#")
    data = json.loads((REPO / file).read_text())
    terms = re.split(r" ([+-]) ", expression)
    total = None
    for sign, keys in zip(["+", *terms[1::2]], terms[0::2], strict=True):
        value = data
        for quoted, plain in re.findall(r'"([^"]+)"|([^/]+)', keys):
            value = value[int(plain)] if isinstance(value, list) and plain.isdigit() else value[quoted or plain]
        if len(terms) == 1:
            return value
        if not isinstance(value, (int, float)):
            raise TypeError(f"{keys} holds {value!r}, not a number")
        total = (total or 0) + (value if sign == "+" else -value)
    return total


def problems(row: dict) -> list[str]:
    """What is wrong with one row: [] when its proofs exist and its numbers agree."""
    bad, proofs = [], items(row["proof"])
    if row["kind"] not in KINDS:
        bad.append(f"kind {row['kind']!r} is not one of {sorted(KINDS)}")
    if row["runs_on"] not in RUNS_ON:
        bad.append(f"runs on {row['runs_on']!r} is not one of {sorted(RUNS_ON)}")
    stated = [s.strip() for s in row["stated"].split(",") if s.strip()]
    missing = [s for s in stated if not (REPO / s.split(" ")[0]).is_file()]
    if not stated or missing:
        bad.append(f"stated in: no such file {missing or '(none given)'}")
    if not proofs:
        bad.append("no proof")
    tests = [p for p in proofs if p.startswith("tests/")]
    for proof in proofs:
        if proof.startswith("tests/"):
            if proof.startswith("tests/test_notebooks.py") and importlib.util.find_spec("jupytext") is None:
                continue  # `make test PY=...` with an interpreter that has no notebook tools: not collectable there
            if proof not in collected():
                bad.append(f"{proof}: not collected by pytest")
            elif row["runs_on"] == "CPU" and collected()[proof]:
                bad.append(f"{proof}: marked for GPUs, but the row says it runs on a CPU")
        elif proof.startswith("notebooks/"):
            bad += notebook_problems(proof, row["runs_on"])
        elif proof.startswith("bench/results/"):
            bad += record_problems(proof, stated, row["claim"])
        elif proof.startswith("sample: "):
            if row["kind"] != "sample":
                bad.append(f"{proof}: a sample proves only a sample row")
        elif not proof.startswith("https://"):
            bad.append(f"{proof}: not a test, notebook cell, record, link or sample")
    kinds_need = {"behaviour": ("tests/", "notebooks/"), "measurement": ("bench/results/",),
                  "repeated": ("bench/results/",), "external": ("https://", "tests/"), "sample": ("sample: ",)}
    if row["kind"] in kinds_need and not any(p.startswith(kinds_need[row["kind"]]) for p in proofs):
        bad.append(f"a {row['kind']} row needs a proof starting with {' or '.join(kinds_need[row['kind']])}")
    if row["runs_on"] == "CPU" and not tests and not any(p.startswith("notebooks/") for p in proofs):
        bad.append("runs on CPU, but no test or notebook cell proves it")
    return bad


def notebook_problems(proof: str, runs_on: str) -> list[str]:
    match = re.fullmatch(r"(notebooks/[\w.]+\.ipynb)::Cell (\d+)", proof)
    if not match or not (REPO / match[1]).is_file():
        return [f"{proof}: no such notebook cell"]
    cells = [c for c in json.loads((REPO / match[1]).read_text())["cells"] if c["cell_type"] == "code"]
    if int(match[2]) >= len(cells):
        return [f"{proof}: the notebook has {len(cells)} code cells"]
    if runs_on == "CPU" and "nbval-skip" in cells[int(match[2])].get("metadata", {}).get("tags", []):
        return [f"{proof}: tagged nbval-skip, so `make test` does not run it"]
    return []


def record_problems(proof: str, stated: list[str], claim: str = "") -> list[str]:
    path, _, written = (part.strip() for part in proof.partition("="))
    if not (REPO / path.split("#")[0]).is_file():
        return [f"{proof}: no such record"]
    try:
        value = json_value(path)
    except (KeyError, IndexError, TypeError, ValueError):
        return [f"{proof}: no such key in the record"]
    if not written:
        return []
    if not isinstance(value, (int, float)):
        return [f"{proof}: the record holds {value!r}, not a number"]
    percent = written.endswith("%")
    number = written.rstrip("%").strip().replace(",", "")
    digits = len(number.split(".")[1]) if "." in number else 0
    recorded = round(value * (100 if percent else 1), digits)
    bad = [] if recorded == float(number) else [f"{proof}: the record says {value} ({recorded} at this rounding)"]
    for file in stated[:1] + [f for f in stated[1:] if f.endswith(".md")]:  # each README that repeats it
        text = (REPO / file.split(" ")[0]).read_text()
        if not stated_in_place(written.rstrip("%").strip(), text, claim):
            bad.append(f"{proof}: {written!r} is not stated in a sentence of {file} about this claim")
    return bad


STOP = set("that this with from when what where which their there them then than they each every into only "
           "have does more most also same some other about after before while over under both were will".split())


def words(text: str) -> set[str]:
    """The content words of a text: four letters or more, lower case, without the commonest ones."""
    return {w for w in re.findall(r"[a-z][a-z0-9_-]{3,}", text.lower()) if w not in STOP}


def stated_in_place(number: str, text: str, claim: str) -> bool:
    """Whether `number` stands as a whole number (not inside 2026-11-22 or 10.5) in a sentence of `text` that
    shares at least two content words with the claim (one, for a claim of fewer words)."""
    want = words(claim)
    need = min(2, len(want)) if want else 0
    token = re.compile(r"(?<![\d.,])" + re.escape(number) + r"(?![\d]|[.,]\d)")
    return any(token.search(unit) and len(words(unit) & want) >= need for unit in sentences(text))


def sentences(text: str) -> list[str]:
    """The units a number is read in: a prose sentence, or a table row with its header, the sentence above it
    and the section's heading."""
    units, caption, heading = [], "", ""
    for block in re.split(r"\n\s*\n", text):
        lines = block.strip().splitlines()
        if lines and lines[0].startswith("#"):
            heading = caption = lines[0]
        elif lines and all(line.lstrip().startswith("|") for line in lines):
            units += [f"{heading} {caption} {lines[0]} {line}" for line in lines[1:]]
        else:
            prose = re.split(r"(?<=[.;!?])\s+(?=[A-Z`(*-])", re.sub(r"\s+", " ", block))
            units += prose
            caption = prose[-1]  # the sentence that introduces a table below it
    return units


def test_every_claim_has_a_proof_that_exists_and_numbers_that_match():
    table = rows()
    assert len(table) >= 50, "CLAIMS.md lists the course's claims"
    ids = [r["id"] for r in table]
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})
    wrong = {r["id"]: p for r in table if (p := problems(r))}
    assert not wrong, "\n".join(f"{i}: {'; '.join(p)}" for i, p in wrong.items())


def test_readme_points_to_the_claims_table():
    assert "[CLAIMS.md](CLAIMS.md)" in (REPO / "README.md").read_text()


TP = "bench/results/throughput_gloo_cpu2_2026-11-22.json"
SP = f"`{TP}#ratios/speedup_ws2/median = 0.92`"
SE = "bench/results/stress_elastic_gloo_cpu2_2026-11-28.json"
SD = f"{SE}#runs - passed_without_workaround"  # a derived number: the runs that failed
SAMPLE = f"""
| id | claim | stated in | kind | runs on | proof |
|---|---|---|---|---|---|
| good | 2 DDP processes train at 0.92 of one process's speed | docs/troubleshooting.md | measurement | - | {SP} |
| elsewhere | the bucket count is 0.92 | docs/troubleshooting.md | measurement | - | {SP} |
| second | 2 DDP processes train at 0.92 | docs/troubleshooting.md, 05_collectives/README.md | measurement | - | {SP} |
| off | the ratio is 0.95 | docs/troubleshooting.md | measurement | - | `{TP}#ratios/speedup_ws2/median = 0.95` |
| nokey | x | docs/troubleshooting.md | measurement | - | `{TP}#ratios/nothing = 1` |
| notest | x | README.md | behaviour | CPU | `tests/test_common.py::test_that_does_not_exist` |
| gpu | x | README.md | behaviour | CPU | `tests/test_02_ddp_spawn.py::test_resume_on_a_gpu` |
| nolink | x | README.md | external | - | `see the docs` |
| derived | the restart failed in 7 of 10 runs | 03_ddp_torchrun/README.md | repeated | - | `{SD} = 7` |
| derivedoff | the restart failed in 6 of 10 runs | 03_ddp_torchrun/README.md | repeated | - | `{SD} = 6` |
| derivedtext | the machine minus one | 03_ddp_torchrun/README.md | repeated | - | `{SE}#runs - machine = 4` |
"""


@pytest.mark.parametrize("row_id, expected", [
    ("good", None), ("elsewhere", "is not stated in a sentence of docs/troubleshooting.md"),
    ("second", "is not stated in a sentence of 05_collectives/README.md"), ("off", "the record says"),
    ("nokey", "no such key"), ("notest", "not collected"),
    ("gpu", "marked for GPUs"), ("nolink", "not a test, notebook cell"),
    ("derived", None), ("derivedoff", "the record says 7"), ("derivedtext", "no such key"),
])
def test_the_checker_catches_each_kind_of_broken_row(row_id, expected):
    row = next(r for r in rows(SAMPLE) if r["id"] == row_id)
    found = problems(row)
    if expected is None:
        assert found == []
    else:
        assert any(expected in p for p in found), found


def test_a_number_counts_only_whole_and_in_a_sentence_about_its_claim():
    text = "The run was recorded in 10.5 seconds on 2026-11-22.\n\nSomething else took 7 seconds."
    assert stated_in_place("10.5", text, "the run was recorded in 10.5 seconds")
    assert not stated_in_place("0", text, "the run was recorded in 0 seconds")  # only inside 10.5 and the date
    assert not stated_in_place("7", text, "the run was recorded in 7 seconds")  # a sentence about something else
    table = "Recorded runs:\n\n| run | seconds |\n|---|---:|\n| spawn | 12.5 |"
    assert stated_in_place("12.5", table, "the spawn run took 12.5 seconds")  # a row, read with its header


def test_the_diff_rows_count_what_the_generated_diffs_show():
    """A section's -diff row counts the diff of its chain step (a README may also show a side script's diff)."""
    from tools import chain_diffs

    for row in (r for r in rows() if r["id"].endswith("-diff")):
        stated = row["stated"].split(",")[0].strip()
        readme = (REPO / stated).read_text()
        step = [b for a, b in chain_diffs.CHAIN if b.startswith(Path(stated).parent.name + "/")]
        block = next((m[4] for m in chain_diffs.BLOCK.finditer(readme) if m[3] in step), "")
        shown = re.search(r"Generated by `make diffs` .*?\((\d+) lines added, (\d+) removed\)", block, re.S)
        assert shown, row["id"]
        assert f"{shown[1]} lines added, {shown[2]} removed" in row["claim"], (row["id"], shown.groups())
