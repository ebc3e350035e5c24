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
@pytest.mark.long
def test_every_break_of_every_chain_script_turns_its_named_check_red():
    res = run([PYTHON, REPO / "tools/mutants.py"], timeout=600)  # on a small stand-in of its own
    for script in mutants.SCRIPTS:
        assert re.search(rf"^{re.escape(script)} +unchanged +passes every check$", res.stdout, re.M), res.tail()
        for name in mutants.mutations(script):
            check = mutants.MUTANTS[name][3]
            twin = re.search(rf"^{re.escape(script)} +{name} +same (train\(\)|line) as (\S+): caught there$",
                             res.stdout, re.M)
            if twin:  # the break is in code the twin holds too (compared here again): caught there
                same = (mutants.train_code(twin[2]) == mutants.train_code(script) if twin[1] == "train()" else
                        mutants.line_of(twin[2], name) == mutants.line_of(script, name))
                assert name not in mutants.PLUMBING and same, (script, name, twin[0])
                script_caught = twin[2]
            else:
                script_caught = script
            assert re.search(rf"^{re.escape(script_caught)} +{name} +caught by {check}$", res.stdout, re.M), res.tail()
    assert res.stdout.rstrip().endswith("all caught")


def _eval_pass(rank, indices, n=10):
    return {"ev": "loader", "rank": rank, "train": False, "indices": indices, "dataset_len": n, "sampler": "X"}


def test_evaluation_on_one_rank_is_ok_only_when_it_sees_the_whole_test_set():
    from tools import tracecheck

    whole = {0: [_eval_pass(0, list(range(10)))], 1: []}
    half = {0: [_eval_pass(0, list(range(0, 10, 2)))], 1: []}
    assert tracecheck.check_eval(whole).verdict == "ok"
    assert tracecheck.check_eval(half).verdict == "wrong" and "5 of the 10" in tracecheck.check_eval(half).message


def test_the_resume_and_ran_checks_say_unknown_on_nothing_and_wrong_on_what_breaks():
    from tools import tracecheck

    init = {"ev": "init", "world_size": 2}
    assert tracecheck.check_resume({0: [init], 1: [init]}).verdict == "unknown"  # nothing loaded
    loaded = {"ev": "load", "state": {"scaler": "aa", "optimizer": "bb"}}
    assert tracecheck.check_resume({0: [loaded]}).verdict == "unknown"  # loaded, no step seen after it
    good = {0: [loaded, {"ev": "resumed", "what": "scaler", "digest": "aa"}]}
    fresh = {0: [loaded, {"ev": "resumed", "what": "scaler", "digest": "cc"}]}
    assert tracecheck.check_resume(good).verdict == "ok" and tracecheck.check_resume(fresh).verdict == "wrong"
    ended = {"ev": "exit"}
    assert tracecheck.check_ran({0: [init, ended], 1: [init, ended]}).verdict == "ok"
    assert tracecheck.check_ran({0: [init, ended]}).verdict == "wrong"  # rank 1 never joined
    failed = {"ev": "error", "t": 1.0, "lines": ["Traceback", "FileNotFoundError: no data"]}
    assert "FileNotFoundError" in tracecheck.check_ran({0: [init, ended], 1: [init, failed]}).message
    assert tracecheck.check_ran({0: [init, ended], 1: [init]}).verdict == "unknown"  # no end seen, no error either
