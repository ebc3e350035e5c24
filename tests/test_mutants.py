"""The mutation check, for real: each chain script with its distributed part broken on purpose must turn the
trace check named for that break red (tools/mutants.py), and the unchanged scripts must pass every check."""

import re

import pytest

from harness import PYTHON, REPO, run
from tools import mutants


def test_every_mutation_finds_its_code_exactly_once_in_every_chain_script():
    for script in mutants.SCRIPTS:
        source = (REPO / script).read_text()
        for name in mutants.mutations(script):
            assert mutants.mutate(source, name) != source, (script, name)


@pytest.mark.slow
def test_every_break_of_every_chain_script_turns_its_named_check_red():
    res = run([PYTHON, REPO / "tools/mutants.py"], timeout=600)  # on a small stand-in of its own
    for script in mutants.SCRIPTS:
        assert re.search(rf"^{re.escape(script)} +unchanged +passes every check$", res.stdout, re.M), res.tail()
        for name in mutants.mutations(script):
            check = mutants.MUTANTS[name][3]
            assert re.search(rf"^{re.escape(script)} +{name} +caught by {check}$", res.stdout, re.M), res.tail()
    assert res.stdout.rstrip().endswith("all caught")
