"""The mutation record: breaking the distributed part of mnist_spawn.py turns a test red (make mutants)."""

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import mutants  # noqa: E402


def test_every_mutation_still_finds_its_code_exactly_once():
    source = (REPO / mutants.SCRIPT).read_text()
    for name, (_, before, after, tests) in mutants.MUTANTS.items():
        assert source.count(before) == 1, f"{name}: {before!r} is no longer in {mutants.SCRIPT} exactly once"
        assert before != after and tests


def test_the_recorded_run_caught_every_mutation():
    records = sorted((REPO / "bench/results").glob("mutants_*.json"))
    assert records, "run `make mutants` and commit bench/results/mutants_<date>.json"
    record = json.loads(records[-1].read_text())
    assert record.get("sources") == mutants.sources(), "stale: the script or its tests changed since; run make mutants"
    assert record["unchanged"]["exit_code"] == 0, "the tests must pass on the unchanged script"
    assert set(record["mutants"]) == set(mutants.MUTANTS), "the record must cover every mutation"
    for name, result in record["mutants"].items():
        assert result["caught"] and result["exit_code"] != 0 and result["failed"], name
        assert set(result["failed"]) <= set(mutants.MUTANTS[name][3]), (name, result["failed"])
