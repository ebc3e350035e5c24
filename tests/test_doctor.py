"""make doctor: the check-up of a user's own DDP script is right, or says it cannot tell, on scripts written the
way people write them (tests/doctor_scripts/: a plain loop; Kai Zhang's tutorial style; pytorch/examples' Trainer
style; an IterableDataset sharded and unsharded; an evaluation without no_grad; a crash; a hang; gradient
accumulation with no_sync; mp.spawn; FSDP2)."""

import re
import shutil

import pytest
import torch

from harness import BARE_ENV, PYTHON, REPO, make, run

SCRIPTS = REPO / "tests" / "doctor_scripts"


def verdicts(text: str) -> dict:
    """{check: verdict} from the doctor's check-up lines ("  ok      shards   ...")."""
    return {name: verdict for verdict, name in re.findall(r"^  (\w+) +(\w+) ", text, re.M)}


def doctor(script, *args, tmp_path, expect_rc, through_make=False, bare=None):
    """The script copied alone into an empty folder outside the repository, then checked there (by the tool with 2
    training batches per epoch, or as a user does: make doctor SCRIPT=... ARGS=...)."""
    folder = tmp_path / "project"
    folder.mkdir(exist_ok=True)
    shutil.copy(SCRIPTS / script, folder)
    if through_make:
        # with an interpreter that has no course install, as on a cluster: make gives the doctor its modules
        res = make("doctor", f"SCRIPT={folder / script}", f"ARGS={' '.join(args)}", f"PY={bare}", "NPROC=2",
                   env=BARE_ENV, expect_rc=expect_rc, timeout=150)
    else:
        res = run([PYTHON, REPO / "tools/doctor.py", "--batches", "2", "--timeout", "90", folder / script, *args],
                  expect_rc=expect_rc, timeout=150)
    return res, verdicts(res.stdout), sorted(p.name for p in folder.iterdir())


# destroy_process_group while the DDP model is still alive: a rank sometimes aborts in the teardown, after its work
# (advice, not a failure: pytorch/examples' toy torchrun script aborted so in 8 of 40 runs on this course's machines)
CLEAN = ("ok", "advice")
ALL_OK = {"shards": "ok", "order": "ok", "ddp": "ok", "eval": "ok", "eval_sum": "ok", "finish": CLEAN}
CORPUS = {  # id: (script, its arguments, the doctor's exit code, verdicts expected, files the script writes)
    # the plain loop, evaluating without no_grad: a training pass is told by its optimizer steps, not by autograd
    # being on (the loop's other runs: crash-in-epoch-2, and the CUDA test below)
    "eval-without-no-grad": ("plain_loop.py", ["--eval-with-grad"], 0, ALL_OK, []),
    "crash-in-epoch-2": ("plain_loop.py", ["--crash-in-epoch", "2"], 2, {"finish": "failed", "shards": "ok"}, []),
    # BatchNorm evaluated through the wrapper, a padding DistributedSampler, two reduces to rank 0, no destroy
    "kaizhang-tutorial": ("kaizhang_style.py", ["-b", "64", "-e", "2"], 1,
                          {"shards": "ok", "order": "ok", "ddp": "ok", "buffers": "ok", "eval": "wrong",
                           "eval_sum": "ok", "finish": "advice"}, []),
    # a peek at one batch each epoch, before set_epoch; a snapshot written by rank 0
    "examples-trainer": ("trainer_style.py", ["2", "1"], 0,
                         {"shards": "ok", "order": "ok", "ddp": "ok", "writer": "ok", "eval": "unknown",
                          "finish": CLEAN},
                         ["snapshot.pt"]),
    "iterable-sharded": ("iterable_stream.py", [], 0, {"shards": "ok", "ddp": "ok"}, []),
    "iterable-unsharded": ("iterable_stream.py", ["--unsharded"], 1, {"shards": "wrong", "ddp": "ok"}, []),
    "accumulate-no-sync": ("accumulate.py", [], 0, {"shards": "ok", "order": "ok", "ddp": "ok", "finish": CLEAN}, []),
    "mp-spawn": ("spawn_style.py", [], 0, {**ALL_OK, "buffers": "ok"}, []),
    "fsdp2": ("fsdp2_style.py", [], 0, ALL_OK, []),  # sharded parameters are no drifted replicas
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CORPUS))
def test_the_corpus_of_user_scripts_gets_its_verdicts(tmp_path, case, bare):
    script, args, rc, expected, files = CORPUS[case]
    through_make = case == "kaizhang-tutorial"  # the README's example, through make with a bare interpreter
    res, found, left = doctor(script, *args, tmp_path=tmp_path, expect_rc=2 if through_make and rc else rc,
                              through_make=through_make, bare=bare)
    wrong = {name: found.get(name) for name, want in expected.items() if found.get(name) not in
             (want if isinstance(want, tuple) else (want,))}
    assert not wrong, res.tail()
    assert left == sorted([script, *files]), "the doctor writes nothing into the user's folder"
    if through_make:  # make exits 2 whenever a recipe fails; its last line carries the doctor's own code
        assert re.search(rf"\[Makefile:\d+: doctor\] Error {rc}$", res.stderr.strip()), res.tail()
    if case == "kaizhang-tutorial":
        assert "1 test sample(s) counted twice, 1002 counted for 1001" in res.stdout  # 1001 samples, padded
        assert "by up to 0.1 percentage points" in res.stdout and "Subset(" in res.stdout and "drop_last" in res.stdout
        assert re.search(r"^  wrong   eval .*\(section 05\)$", res.stdout, re.M), res.tail()  # where the fix is taught
        assert "never called destroy_process_group()" in res.stdout
        assert "2 epoch(s)" in res.stdout and "verdict: WRONG: eval " in res.stdout
    if case in ("examples-trainer", "eval-without-no-grad"):
        assert "2 epoch(s)" in res.stdout, res.tail()  # the peek and the evaluations are no epochs
    if case == "examples-trainer":  # exit code 0 with advice: advice and information do not count
        assert found["timeout"] == "advice" and found["batch"] == "info", res.tail()
    if case == "crash-in-epoch-2":
        assert "verdict: FAILED: rank 1 failed: ValueError: labels out of range in batch 1 of epoch 2" in res.stdout
        assert 'raise ValueError(f"labels out of range' in res.stderr  # the failing rank's own last lines
    if case == "iterable-sharded":
        assert "the ranks' items are disjoint (800 in a whole pass" in res.stdout
    if case == "iterable-unsharded":
        assert "800 item(s) on more than one rank" in res.stdout
    if case == "accumulate-no-sync":
        assert "8 samples per batch per rank x 2 batches per step x 2 ranks = 32 per optimizer step" in res.stdout
    assert res.seconds < 60, "bounded by the script's own work, not by the doctor's limit"


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_script_that_needs_cuda_on_a_machine_without_it_gets_one_line(tmp_path):
    res, _, _ = doctor("plain_loop.py", "--device", "cuda", tmp_path=tmp_path, expect_rc=2)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.tail()
    assert lines[0].startswith("doctor: error: the script needs CUDA and this machine has none (")
    assert "torch.cuda.is_available() is False (section 02)" in lines[0] and "Traceback" not in res.output


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


def test_a_rank_that_aborts_only_at_exit_gets_advice_and_one_that_raised_fails():
    """tools/doctor.py's finish check, on what a run left: every rank reached its end and left the group, and the
    launcher reports rank 1 killed by SIGABRT (as Gloo's teardown can do at exit): advice, not FAILED. The same
    exit with rank 1 stopped by an error of its own is a failure."""
    from tools import doctor

    def ranks(*of_rank_1):
        began, ended = [{"ev": "init", "world_size": 2, "timeout": 60.0}], [{"ev": "destroy"}, {"ev": "exit"}]
        return {0: began + ended, 1: [*began, *of_rank_1, *ended]}

    summary = "[1]:\n  time      : 0\n  host      : x\n  rank      : 1 (local_rank: 1)\n  exitcode  : -6 (pid: 9)\n"
    finish = {c.name: c for c in doctor.extra_checks(ranks(), 1, summary, REPO / "no-trace")}
    assert finish["finish"].verdict == "advice" and "aborted (SIGABRT) after destroy_process_group()" in \
        finish["finish"].message
    # the fix 02 teaches: returning from the function that built the model does not free it (a reference cycle)
    assert "gc.collect() just before destroy_process_group()" in finish["finish"].message
    assert "returns first" not in finish["finish"].message
    assert "timeout" not in finish  # init_process_group got a timeout
    failed = doctor.extra_checks(ranks({"ev": "error", "lines": ["ValueError: x"]}), 1, summary, REPO / "no-trace")
    assert doctor.failure(ranks({"ev": "error", "lines": ["ValueError: x"]}), 1, summary, REPO / "no-trace") == \
        ("rank 1 failed (signal 6)", 1)
    assert {c.name: c.verdict for c in failed}["finish"] == "failed"
