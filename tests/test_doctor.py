"""make doctor: the check-up of a user's own DDP script finds what is broken, and only that."""

import re
import shutil

import pytest

from harness import BARE_ENV, PYTHON, REPO, make, run

SCRIPTS = REPO / "tests" / "doctor_scripts"


def verdicts(text: str) -> dict:
    """{check: verdict} from the doctor's check-up lines ("  ok      shards   ...")."""
    return {name: verdict for verdict, name in re.findall(r"^  (\w+) +(\w+) ", text, re.M)}


def doctor(script, *args, tmp_path, expect_rc, timeout=180, through_make=False, bare=None):
    """The script copied alone into an empty folder outside the repository, then checked there (by the tool, or
    as a user does: make doctor SCRIPT=... ARGS=...)."""
    folder = tmp_path / "project"
    folder.mkdir(exist_ok=True)
    shutil.copy(SCRIPTS / script, folder)
    if through_make:
        # with an interpreter that has no course install, as on a cluster: make gives the doctor its modules
        res = make("doctor", f"SCRIPT={folder / script}", f"ARGS={' '.join(args)}", f"PY={bare}",
                   env=BARE_ENV, expect_rc=expect_rc, timeout=timeout)
    else:
        res = run([PYTHON, REPO / "tools/doctor.py", "--timeout", "120", folder / script, *args],
                  expect_rc=expect_rc, timeout=timeout)
    return res, verdicts(res.stdout), sorted(p.name for p in folder.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("script, args, rc, expected, files", [
    ("trainer_style.py", [], 0, {"shards": "ok", "order": "ok", "ddp": "ok", "writer": "ok", "finish": "ok"},
     ["snapshot.pt"]),
    ("trainer_style.py", ["--bug", "every-rank-saves"], 1, {"writer": "wrong", "shards": "ok"}, ["snapshot.pt"]),
    ("kaizhang_style.py", [], 1, {"eval": "wrong", "eval_sum": "ok", "shards": "ok", "order": "ok"}, []),
    ("kaizhang_style.py", ["--exact"], 0, {"eval": "ok", "eval_sum": "ok", "ddp": "ok"}, []),
    ("spawn_style.py", [], 0, {"shards": "ok", "ddp": "ok", "buffers": "ok", "eval": "ok", "eval_sum": "ok"}, []),
    ("spawn_style.py", ["--bug", "no-buffer-broadcast"], 1, {"buffers": "wrong", "ddp": "ok"}, []),
], ids=["trainer", "trainer-every-rank-saves", "kaizhang-padded-eval", "kaizhang-exact", "spawn",
        "spawn-no-buffer-broadcast"])
def test_user_scripts_in_three_styles_get_the_right_verdicts(tmp_path, script, args, rc, expected, files, bare):
    through_make = args == ["--exact"]  # the README's example: make doctor SCRIPT=... ARGS=--exact
    res, found, left = doctor(script, *args, tmp_path=tmp_path, expect_rc=rc, through_make=through_make, bare=bare)
    assert {name: found.get(name) for name in expected} == expected, res.tail()
    assert left == sorted([script, *files]), "the doctor writes nothing into the user's folder"
    if expected.get("eval") == "wrong":
        assert "1 test sample(s) counted more than once" in res.stdout  # 1001 samples, padded to 1002
    if through_make:
        assert "verdict: nothing wrong found" in res.stdout


@pytest.mark.slow
@pytest.mark.waits
def test_a_hanging_script_is_stopped_naming_the_waiting_rank_and_nothing_is_left(tmp_path):
    folder = tmp_path / "project"
    folder.mkdir()
    shutil.copy(SCRIPTS / "hangs.py", folder)
    res = run([PYTHON, REPO / "tools/doctor.py", "--timeout", "12", folder / "hangs.py"], expect_rc=2, timeout=90)
    assert "stopped after 12 s; still running:" in res.stderr and "rank 0 (last seen: coll all_reduce)" in res.stderr
    assert res.seconds < 60  # harness.run also checks that no process is left behind


def test_a_script_that_is_not_there_or_cannot_run_is_one_line(tmp_path):
    res = run([PYTHON, REPO / "tools/doctor.py", tmp_path / "nope.py"], expect_rc=2)
    assert res.stderr.strip() == f"doctor: error: {tmp_path / 'nope.py'} is not a Python script"
    res = make("doctor", expect_rc=2)
    assert "name your script: make doctor SCRIPT=" in res.stderr
