"""The foundation as a user meets it: make targets, the baseline run, copying a script, the diff tool."""

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import common
from harness import BARE_ENV, DEAD_PROXY, OUTER_MAKE, PYTHON, REPO, TEST_IMAGES, TORCHRUN, exits, make, python, run
from tools import tracecheck


@pytest.mark.slow
def test_make_smoke_trains_the_baseline(data_dir):
    # TQDM_DISABLE unset, as in a user's shell: the progress bar stays silent in a pipe (the terminal's is below)
    res = make("smoke", f"ARGS=--data-dir {data_dir} --max-steps 120 --log-every 1", env={"TQDM_DISABLE": None},
               timeout=300)  # a third
    assert "epoch 1:" not in res.stderr, res.tail()
    final = res.final
    # the epoch line's train_loss is the mean over the epoch's batches (all of 64 samples), not the last batch's
    steps = [float(x) for x in re.findall(r"^step: epoch=1 step=\d+ loss=(\S+)$", res.stdout, re.M)]
    (epoch,) = re.findall(r"^epoch 1/1: train_loss=(\S+) ", res.stdout, re.M)
    assert len(steps) == 120 and abs(float(epoch) - sum(steps) / 120) < 2e-4 and float(epoch) != steps[-1]
    assert final["world_size"] == 1 and final["epochs"] == 1 and final["dataset"] == "mnist-standin"
    assert final["test_samples"] == TEST_IMAGES == 1000  # the tests' stand-in: 1,000 of its 4,000 test images
    assert 0.9 < final["test_acc"] < 1.0, "120 steps should learn the stand-in well, but not perfectly"


# What the README's "Use a script in your own project" tells a reader to change: the data set and the model.
USER_CODE = """
class Squares(torch.utils.data.Dataset):  # an ordinary Dataset: one int index, one sample of another shape
    def __init__(self, train):
        g = torch.Generator().manual_seed(0 if train else 1)
        self.x = torch.randn(512 if train else 128, 12, generator=g)
        self.y = (self.x[:, :3].sum(1) > 0).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class MLP(torch.nn.Sequential):
    def __init__(self):
        super().__init__(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
"""
EDITS = [(r"common\.load_dataset\(args\.dataset, args\.data_dir, train=(True|False)\)", r"Squares(train=\1)"),
         (r"common\.ConvNet\(\)", "MLP()"),
         (r"\n *(if local_rank == 0:.*\n *)?(args\.dataset = )?common\.prepare_data\(.*", "")]


def copy_into_a_project(script: str, folder: Path) -> Path:
    """The chain script and what it imports (common.py) in a folder of their own, with the README's edits."""
    folder.mkdir()
    shutil.copy(REPO / "common.py", folder)
    with open(folder / "common.py", "a") as f:  # proof that the copy, not the repo's common.py, is imported
        f.write("\nprint('common.py from the copy', flush=True)\n")
    source = (REPO / script).read_text().replace("\nimport common\n", "\nimport common\n" + USER_CODE)
    for pattern, replacement in EDITS:
        source, n = re.subn(pattern, replacement, source)
        assert n, (script, pattern)
    assert "load_dataset" not in source and "ConvNet" not in source and "prepare_data" not in source
    (folder / Path(script).name).write_text(source)
    return folder / Path(script).name


@pytest.mark.slow
def test_a_copied_chain_script_trains_another_dataset_and_model_in_an_empty_folder(tmp_path):
    """Each chain script, copied with common.py alone into another folder, trains an int-indexed Dataset of
    another shape and an MLP with 2 processes; the tracer sees its shards and its equal replicas."""
    env = {"PYTHONPATH": str(REPO / "tools/trace"), "OMP_NUM_THREADS": "1"}
    launches = {
        "03_ddp_torchrun/mnist_torchrun.py": lambda s: [*TORCHRUN, "--standalone", "--nproc-per-node", "2", s],
        "06_amp_syncbn/mnist_amp_syncbn.py": lambda s: [*TORCHRUN, "--standalone", "--nproc-per-node", "2", s],
        "02_ddp_spawn/mnist_spawn.py": lambda s: [PYTHON, s, "--nproc", "2"],
    }
    for script, launch in launches.items():
        project = tmp_path / Path(script).stem
        copied = copy_into_a_project(script, project)
        res = run([*launch(copied), "--epochs", "2", "--batch-size", "32", "--timeout", "30"], cwd=project,
                  env={**env, "COURSE_TRACE": str(project / "trace")}, timeout=180)
        assert res.final["test_samples"] == 128 and res.final["world_size"] == 2, res.tail()
        assert res.final["test_acc"] > 0.7 and "common.py from the copy" in res.stdout, res.tail()
        assert len(re.findall(r"^epoch \d/2: train_loss=", res.stdout, re.M)) == 2, res.tail()  # rank 0 alone
        assert re.search(r"^2 processes\b.* on (cpu|cuda) with (gloo|nccl)\b", res.stdout, re.M), res.tail()
        verdicts = {c.name: c.verdict for c in tracecheck.judge(project / "trace")}
        assert verdicts["shards"] == verdicts["order"] == verdicts["ddp"] == verdicts["eval"] == "ok", verdicts
    # the tcp step: two processes started by hand, with Kai Zhang's rank and world size alone (on one machine
    # that is enough: local rank = rank)
    port = common.free_port()
    project = tmp_path / "mnist_tcp"
    copied = copy_into_a_project("04_multinode_tcp/mnist_tcp.py", project)
    procs = [[PYTHON, copied, "--init-method", f"tcp://127.0.0.1:{port}", "--world-size", "2", "--rank", str(r),
              "--epochs", "2", "--timeout", "30"] for r in range(2)]
    res = run(["bash", "-c", f"{shlex.join(map(str, procs[1]))} & p1=$!; {shlex.join(map(str, procs[0]))}; a=$?; "
               "wait $p1; echo exits $a $?"], cwd=project, env={**env, "COURSE_TRACE": str(project / "trace")},
              timeout=180)
    assert "exits 0 0" in res.stdout and "rank 1 (local rank 1) of 2 joined via tcp://" in res.stdout, res.tail()
    assert res.final["test_samples"] == 128 and res.final["world_size"] == 2, res.tail()
    verdicts = {c.name: c.verdict for c in tracecheck.judge(project / "trace")}
    assert verdicts["shards"] == verdicts["order"] == verdicts["ddp"] == verdicts["eval"] == "ok", verdicts


# Every script a README tells people to copy, what it imports besides itself, and the flags that pull that in
COPYABLE = {
    "01_dataparallel/mnist_single.py": ([], []),
    "01_dataparallel/mnist_dataparallel.py": ([], []),
    "02_ddp_spawn/mnist_spawn.py": ([], ["--nproc", "1"]),
    "03_ddp_torchrun/mnist_torchrun.py": ([], []),
    "04_multinode_tcp/mnist_tcp.py": ([], []),
    # on the CPU also on a GPU machine: the all_reduce batch norm of syncbn_by_hand.py is the CPU's SyncBatchNorm
    "06_amp_syncbn/mnist_amp_syncbn.py": (["06_amp_syncbn/syncbn_by_hand.py"], ["--sync-bn", "--device", "cpu"]),
}


@pytest.mark.slow
def test_each_copyable_script_trains_from_an_empty_folder_offline_without_the_course(bare, data_dir, tmp_path):
    """Each script as a user copies it: into an empty folder with only what it imports (common.py, and for step 6
    with --sync-bn syncbn_by_hand.py), run by an interpreter that holds torch but not the course (no tools, no
    workarounds), offline, on a data folder already on disk: the stand-in's files. One process each, started as
    its README starts it (what 2 ranks do is the other tests'), but step 6 with 2: its batch norm all-reduces."""
    data = tmp_path / "data"  # a prepared data folder, as `make data` leaves it
    shutil.copytree(data_dir, data, copy_function=os.link, ignore=shutil.ignore_patterns("*.lock"))
    env = {**BARE_ENV, **DEAD_PROXY, "OMP_NUM_THREADS": "1"}
    short = ["--dataset", "mnist-standin", "--data-dir", data, "--epochs", "1", "--max-steps", "3", "--timeout", "30"]
    torchrun = [bare, "-m", "torch.distributed.run", "--standalone", "--local-addr", "127.0.0.1", "--nproc-per-node"]
    for script, (helpers, flags) in COPYABLE.items():
        project = tmp_path / Path(script).stem
        project.mkdir()
        for file in ["common.py", script, *helpers]:
            shutil.copy(REPO / file, project)
        copied = project / Path(script).name
        ranks = 2 if "amp_syncbn" in script else 1
        if "torchrun" in script or "amp_syncbn" in script:
            res = run([*torchrun, str(ranks), copied, *short, *flags], cwd=project, env=env, timeout=180)
        elif "tcp" in script:  # started by hand, meeting at rank 0's address
            port = common.free_port()
            res = run([bare, copied, "--init-method", f"tcp://127.0.0.1:{port}", "--world-size", "1", "--rank", "0",
                       *short], cwd=project, env=env, timeout=180)
        else:
            res = run([bare, copied, *short, *flags], cwd=project, env=env, timeout=180)
        final = res.final
        assert final["test_samples"] == TEST_IMAGES and final["dataset"] == "mnist-standin", res.tail()
        assert final["world_size"] == ranks, res.tail()
        assert "Traceback" not in res.stderr, res.tail()
    assert "sync-bn True" in res.stdout, res.tail()  # the step-6 run, with the all_reduce batch norm on a CPU
    # ... which needs the helper it was copied with: without it, the same command stops at the import
    (project / "syncbn_by_hand.py").unlink()
    res = run([*torchrun, "1", copied, *short, "--sync-bn", "--device", "cpu"], cwd=project, env=env, timeout=120,
              expect_rc=1)
    assert "No module named 'syncbn_by_hand'" in res.stderr, res.tail()


def test_bad_input_is_one_line_not_a_traceback(tmp_path):
    """Through the preflight the make targets run first."""
    script = "01_dataparallel/mnist_single.py"
    (code1, _, err1), (code2, _, err2) = exits([
        ("tools/preflight.py", [script, "--dataset", "imagenet"]),
        ("tools/preflight.py", [script, "--dataset", "mnist", "--data-dir", tmp_path / "empty"])], env=DEAD_PROXY)
    assert code1 == 2 and "invalid choice: 'imagenet'" in err1 and "Traceback" not in err1
    assert code2 == 2 and "make data" in err2 and "Traceback" not in err2


@pytest.mark.parametrize("nproc", ["0", "two", ""])
def test_make_refuses_a_bad_nproc(nproc):
    res = make("check-nproc", f"NPROC={nproc}", expect_rc=2)
    assert "NPROC must be a whole number of at least 1" in res.stderr


def test_make_help_documents_every_target():
    makefile = (REPO / "Makefile").read_text().replace("\\\n", " ")  # join continued lines
    phony = set(" ".join(re.findall(r"^\.PHONY:(.*)$", makefile, re.M)).split())
    documented = set(re.findall(r"^([a-z0-9][a-z0-9-]*):.*## ", makefile, re.M))
    helpers = {"check-nproc", "check-nnodes"}
    assert phony - helpers == documented, (f"without a help line: {phony - helpers - documented}; "
                                           f"not .PHONY: {documented - phony}")
    out = make("help").stdout
    for target in documented:
        assert re.search(rf"^  {re.escape(target)} ", out, re.M), target


def test_chain_diffs_in_readmes_are_current():
    res = python("tools/chain_diffs.py", "--check", expect_rc=None)
    assert res.returncode == 0, res.stderr


def test_the_front_door_is_short_and_its_links_point_at_what_exists():
    """README.md is a door: at most about 150 lines (its "DDP in one screen" is a whole program: test_03 runs it);
    every relative link of the READMEs and docs pages points at something that exists."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    pages = [REPO / "README.md", REPO / "README.zh-CN.md", *(REPO / "docs").glob("*.md")]
    for page in pages:
        for link in re.findall(r"\]\((?!https?://|#)([^)\s#]+)", page.read_text()):
            assert (page.parent / link).exists(), f"{page.relative_to(REPO)}: {link}"


def test_the_front_doors_map_is_the_chain_and_its_cpu_only_demos_are_the_gpu_checks():
    """README.md's table names each section's chain script and the script it continues, as tools/chain_diffs.py
    chains them (05 has none); the demos it says stay on the CPU by design are those bench/gpu_check.py runs on the
    CPU even on a machine of 8 GPUs; and the path it proposes (this page, 02, 03) is about 30 minutes of reading:
    at most 6,300 words, the generated diffs included (200 words a minute)."""
    from tools import chain_diffs

    readme = (REPO / "README.md").read_text()
    rows = re.findall(r"^\| \[(0\d)_\w+\]\(\S+\) \| ([^|]+) \|", readme, re.M)
    assert [folder for folder, _ in rows] == ["01", "02", "03", "04", "05", "06", "07"], rows
    shown = set()
    for folder, cell in rows:
        for script, parent in re.findall(r"`(\w+\.py)`(?:, from (0\d)| from it)", cell):
            parent = parent or folder  # "from it": the section's first script, the baseline
            shown.add((parent, f"{folder}/{script}"))
    chained = {(a.split("_")[0], b.split("_", 1)[0] + "/" + b.rsplit("/", 1)[1]) for a, b in chain_diffs.CHAIN}
    assert shown == chained, (shown ^ chained)
    assert not [step for step in chain_diffs.CHAIN if step[1].startswith("05_")]

    if str(REPO / "bench") not in sys.path:
        sys.path.insert(0, str(REPO / "bench"))  # gpu_check imports benchlib beside it
    import gpu_check
    by_design = set(gpu_check.CPU_BY_DESIGN)
    sentence = " ".join(readme.partition("on the CPU by design:")[2].partition("\n\n")[0].split())
    assert by_design and set(re.findall(r"`make ([a-z-]+)`", sentence)) == by_design, (sentence, by_design)

    words = sum(len((REPO / f).read_text().split()) for f in ("README.md", "02_ddp_spawn/README.md",
                                                             "03_ddp_torchrun/README.md"))
    assert words <= 6300 and "about 30 minutes" in " ".join(readme.split()), words


def test_preparing_the_data_imports_nothing_that_imports_common_back():
    """common.prepare_data asks tools/data.py; that module (and the stand-in writer) must not import common.py or
    torch, or the import goes round in a circle that only a lazy import keeps alive."""
    code = ("import sys; import tools.data, tools.standins, tools.util; "
            "print(sorted(m for m in ('common', 'tools.course', 'torch') if m in sys.modules))")
    res = run([PYTHON, "-c", code], env={"PYTHONPATH": str(REPO)}, cwd=REPO)
    assert res.stdout.strip() == "['torch']", res.stdout  # the stand-ins are made with torch; nothing else


def test_ci_runs_the_readme_test_command():
    ci = (REPO / ".ci" / "run").read_text()
    readme = (REPO / "README.md").read_text()
    assert re.search(r"^make test$", ci, re.M), "CI runs exactly `make test`"
    assert re.search(r"^make test +#", readme, re.M), "the README's test command is `make test`"


# ------------------------------------------------------------------ what the top README says about the setup


def test_python_3_10_is_enough_as_the_readme_and_pyproject_say():
    """README.md: "Python 3.10+". pyproject.toml asks for it, and every Python file of the course parses with
    3.10's grammar (this interpreter may be newer)."""
    import ast

    assert re.search(r"^requires-python = \">=3\.10\"$", (REPO / "pyproject.toml").read_text(), re.M)
    assert "Python 3.10+" in (REPO / "README.md").read_text()
    files = [p for p in REPO.rglob("*.py") if not any(part.startswith(".") or part in ("data", "runs")
                                                      for part in p.relative_to(REPO).parts[:-1])]
    assert len(files) > 50
    for path in files:
        ast.parse(path.read_text(), str(path), feature_version=(3, 10))


def test_each_section_readme_ends_with_its_pitfalls_and_links_its_differences_from_the_notes():
    """README.md and docs/source-notes.md: each section README ends with its pitfalls (05's are its error gallery)
    and one line linking its part of docs/source-notes.md, where the course departs from the notes; that part
    exists and holds a table."""
    readmes = sorted(REPO.glob("0[0-9]_*/README.md"))
    assert len(readmes) == 7
    notes = (REPO / "docs/source-notes.md").read_text()
    anchors = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-"): h for h in re.findall(r"^## (.+)$", notes, re.M)}
    for readme in readmes:
        text = readme.read_text()
        headings = re.findall(r"^## (.+)$", text, re.M)
        assert headings[-1] in ("Pitfalls", "The error gallery"), (readme, headings[-1])
        last = text.strip().splitlines()[-1]
        link = re.fullmatch(r"Where this section departs from the source notes, and why: "
                            r"\[docs/source-notes\.md\]\(\.\./docs/source-notes\.md#([\w-]+)\)\.", last)
        assert link, (readme, last)
        heading = anchors.get(link.group(1))
        assert heading and heading.startswith(readme.parent.name + ": "), (readme, link.group(1), sorted(anchors))
        part = notes.partition(f"## {heading}\n")[2].split("\n## ")[0]
        assert "| the notes say or do |" in part, heading


def test_make_test_runs_two_workers_and_test_fast_leaves_out_the_slow_tests_and_the_notebooks():
    """docs/tests.md: `make test` runs the tests and the notebooks on 2 pytest workers (where pytest-xdist is
    there); `make test-fast` runs the tests not marked slow, without the notebooks; `make distclean` also removes
    the virtualenv and the data."""
    makefile = (REPO / "Makefile").read_text()
    recipe = lambda target: re.search(rf"^{target}:.*\n((?:\t.*\n)+)", makefile, re.M).group(1)  # noqa: E731
    test, fast = recipe("test"), recipe("test-fast")
    assert 'echo "-n 2"' in test and "$(PYTEST) $$xd tests $$nb" in test and "notebooks $(NBVAL)" in test
    assert fast.strip() == '$(PYTEST) tests -m "not slow" $(ARGS)'
    assert re.search(r"^distclean: clean\b", makefile, re.M) and "rm -rf $(VENV) data" in recipe("distclean")


def test_a_test_that_starts_three_ranks_waits_for_the_machine_to_itself(monkeypatch, tmp_path):
    """harness.cores: under pytest-xdist a test that starts processes shares a lock with the other worker's; one
    marked ranks(n) holds it alone. Without xdist there is nobody to share with."""
    import fcntl

    import harness

    taken = []
    monkeypatch.setattr(harness.fcntl, "flock", lambda file, mode: taken.append(mode))
    monkeypatch.setattr(harness.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.delenv("PYTEST_XDIST_TESTRUNUID", raising=False)
    with harness.cores(alone=True):
        pass
    assert taken == []
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", "run")
    for alone in (False, True):
        with harness.cores(alone):
            pass
    assert taken == [fcntl.LOCK_SH, fcntl.LOCK_EX]


def test_no_numbered_script_imports_the_course_machinery_and_each_workaround_says_why():
    """docs/tests.md: no script of a numbered folder imports workarounds.py or tools/; each gc.collect() before a
    destroy_process_group() says why where it stands; each workaround in workarounds.py is a named call with a
    docstring."""
    import ast

    scripts = sorted(REPO.glob("0[0-9]_*/*.py"))
    assert len(scripts) >= 30
    for script in scripts:
        source = script.read_text()
        tree = ast.parse(source)
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.module}
        assert not imported & {"tools", "workarounds"}, (script.name, sorted(imported))
        lines = source.splitlines()
        for i, line in enumerate(lines):
            if line.strip().startswith("gc.collect()"):
                assert "reference cycles" in " ".join(lines[max(0, i - 2):i + 1]), f"{script.name}:{i + 1}"
    tree = ast.parse((REPO / "workarounds.py").read_text())
    calls = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name != "enabled"]  # the switch
    assert calls and all(ast.get_docstring(node) for node in calls)


def test_setup_pins_the_matched_pair_and_this_is_it():
    import torch
    import torchvision

    pins = (REPO / "requirements.txt").read_text()
    assert "torch==2.14.1" in pins and "torchvision==0.29.1" in pins
    dev = (REPO / "requirements-dev.txt").read_text()  # the course's .venv: its notebook and test tools on top
    assert "-r requirements.txt" in dev and all(f"\n{tool}==" in dev for tool in ("pytest", "nbval", "jupytext"))
    if Path(sys.prefix) == REPO / ".venv":  # `make test PY=...` runs these tests with another torch
        assert torch.__version__.startswith("2.14.1") and torchvision.__version__.startswith("0.29.1")


def test_make_runs_with_an_existing_interpreter_and_says_which_torch():
    """`make ... PY=python3` (no .venv, no package index): the torch found is named, an interpreter without torch
    is refused in one line."""
    found = make("existing-python", f"PY={PYTHON}")
    assert f"using {PYTHON}: torch {torch.__version__.split('+')[0]}" in found.stdout
    refused = make("smoke", f"PY={PYTHON} -S", expect_rc=2)  # -S: without site-packages, so without torch
    assert "has no torch; install torch==" in refused.stderr and "Traceback" not in refused.stderr
    assert "pip install" not in make("-n", "test", "PY=python3").stdout


def test_check_torch_refuses_a_torch_older_than_the_oldest_that_ran(monkeypatch, capsys):
    from tools import check_torch

    monkeypatch.setattr(check_torch, "installed", lambda name: "2.10.1")
    monkeypatch.setattr("sys.argv", ["check_torch.py"])
    assert check_torch.main() == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has torch 2.10.1; the course runs on 2.11 to 2.14.1" in err, err
    monkeypatch.setattr(check_torch, "installed", lambda name: "2.11.0")
    assert check_torch.main() == 0 and "torch 2.11.0; the course is tested with 2.14.1" in capsys.readouterr().out


def test_make_test_runs_what_another_interpreter_can_and_says_what_it_skips(tmp_path):
    """`make test PY=...` with an interpreter that has pytest but no ruff and no nbval: lint and the notebooks are
    skipped with a line each; one without pytest is refused in one line. A stand-in interpreter answers make."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\ncase "$*" in\n  *"import pytest"*) [ -n "$NO_PYTEST" ] && exit 1; exit 0;;\n'
                    '  *"-m pytest"*) echo "RAN pytest $*";;\n  *check_torch*) echo "using it";;\n'
                    '  *) exit 1;;\nesac\n')
    fake.chmod(0o755)
    out = make("test", f"PY={fake}").stdout
    assert f"lint skipped: {fake} has no ruff" in out and f"notebooks skipped: {fake} has no nbval" in out
    assert re.search(r"^RAN pytest -m pytest +tests *$", out, re.M), out  # no -n 2 (no xdist), no notebooks
    refused = make("test", f"PY={fake}", env={"NO_PYTEST": "1"}, expect_rc=2)
    first = refused.stderr.strip().splitlines()[0]
    assert first == f"error: {fake} has no pytest: install pytest into it (pytest-timeout and pytest-xdist help)"
    assert "RAN pytest" not in refused.stdout


def test_the_torch_range_is_the_range_that_ran():
    """The course claims the torch versions whose whole suite has passed: a compat record (make compat TORCH=...)
    for the pinned torch and for the oldest that check_torch accepts, that one with matplotlib and without (a GPU
    host's Python may hold it or not); docs/setup.md quotes each with its date."""
    from tools import check_torch, compat

    ran, extras, behaves = {}, {}, {}
    for path in sorted((REPO / "bench" / "results").glob("compat_torch-*.json")):
        record = json.loads(path.read_text())
        suite = record.get("suite")
        if suite and record["all_passed"]:
            assert suite["exit"] == 0 and suite["failed"] == suite["errors"] == 0 and suite["passed"] > 300, path
            assert record["interpreter"].startswith(".venv-torch") and " -m pytest -n 2 tests " in suite["command"]
            assert suite["command"].endswith(f"--deselect {compat.RECORD_READER} -p no:cacheprovider"), path
            version = record["torch"].split("+")[0]
            ran[version] = record["date"]
            extras.setdefault(version, set()).add(record["matplotlib"])
            if "behaviour" in record:
                behaves[version] = record["behaviour"]
    pinned = re.search(r"^torch==(\S+)", (REPO / "requirements.txt").read_text(), re.M).group(1)
    oldest = min(ran, key=check_torch.version)
    assert pinned in ran and check_torch.OLDEST == check_torch.version(oldest) == (2, 11), ran
    assert extras[oldest] == {True, False}, "the oldest torch, beside matplotlib and without it"
    # what docs/setup.md and section 05 say of 2.11 against the pinned torch, as the tests' own probes found it
    assert behaves[oldest] == {"gloo_list_all_to_all": False, "two_forwards_with_synced_buffers_raise": True}
    assert behaves[pinned] == {"gloo_list_all_to_all": True, "two_forwards_with_synced_buffers_raise": False}
    readme = " ".join((REPO / "docs" / "setup.md").read_text().split())
    for version, date in ran.items():
        assert f"torch {version} ({date})" in readme, version
    assert compat.torchvision_for("2.11.0") == "0.26.*" and compat.torchvision_for(pinned) == "0.29.*"
    assert {"pytest-xdist", "pytest-timeout"} <= set(compat.TOOLS), "what a GPU host's Python holds"


def make_copy(tmp_path: Path) -> Path:
    """The course's Makefile and requirements in a folder of their own: make setup there touches nothing here."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    for name in ("Makefile", "requirements.txt", "requirements-dev.txt", "requirements-dev.lock", "pyproject.toml"):
        (tmp_path / name).write_bytes((REPO / name).read_bytes())
    return tmp_path


def test_make_reinstalls_when_the_requirements_change(tmp_path):
    """Beside a .venv installed after the requirements (so that it holds whatever interpreter runs the tests, .venv
    or not): nothing to install; after a change to requirements.txt (-W: as if it had just been written), make
    installs again."""
    folder = make_copy(tmp_path)
    (folder / ".venv/bin").mkdir(parents=True)
    (folder / ".venv/bin/python").symlink_to(PYTHON)
    (folder / ".venv/.installed").touch()
    up_to_date = run(["make", "-n", "smoke"], cwd=folder).stdout
    assert "pip install" not in up_to_date and "mnist_single.py" in up_to_date, up_to_date
    dry = run(["make", "-n", "-W", "requirements.txt", "smoke"], cwd=folder).stdout
    assert "pip install" in dry and "-r requirements-dev.txt" in dry


# A stand-in for python3 (and for the .venv's python it creates): it writes down how it was called, makes a venv
# folder, answers the reachability probe as STUB_INDEX says, and fails a pip install whose words hold STUB_PIP_FAILS.
STUB_PYTHON = """#!/bin/bash
echo "$*" >> "$STUB_LOG"
case "$1 $2" in
  "-m venv") mkdir -p "$3/bin" && cp "$0" "$3/bin/python" && exit 0 ;;
  "-m pip") if [ -n "$STUB_PIP_FAILS" ] && [[ "$*" == *"$STUB_PIP_FAILS"* ]]; then
              echo "ERROR: no matching distribution" >&2; exit 1; fi; exit 0 ;;
esac
if [[ "$2" == *urlopen* ]]; then [ "$STUB_INDEX" = up ]; exit $?; fi
exit 0
"""
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu torch==2.14.1 torchvision==0.29.1"


@pytest.mark.parametrize("gpus, asked, index, fails, build", [
    (0, None, "up", None, "cpu"),  # a laptop: the CPU-only build, by itself
    (0, None, "down", None, "cuda-note"),  # ... whose CPU index cannot be reached: one line, then the CUDA build
    (1, None, "up", None, "cuda"),  # a GPU machine: the CUDA build
    (1, "CPU=1", "up", None, "cpu"),  # either can be asked for
    (0, "CPU=0", "up", None, "cuda"),
    (0, None, "up", "requirements-dev", "failed"),  # an install that fails leaves no .venv behind
], ids=["laptop", "laptop-offline-index", "gpu", "gpu-asks-cpu", "laptop-asks-cuda", "failed"])
def test_the_first_make_installs_the_build_that_fits_the_machine(tmp_path, gpus, asked, index, fails, build):
    """README: on a machine without an NVIDIA GPU the first make installs the CPU-only torch (about 1 GB instead of
    about 6); the CUDA build stays the default where nvidia-smi lists a GPU; CPU=1 / CPU=0 choose. Run for real
    with a stand-in python3 and nvidia-smi, so that nothing is downloaded."""
    folder = make_copy(tmp_path / "course")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\n" + "".join(f"echo 'GPU {i}: NVIDIA H100 (UUID: GPU-{i})'\n"
                                                                for i in range(gpus)))
    (bin_dir / "python3").write_text(STUB_PYTHON)
    for exe in bin_dir.iterdir():
        exe.chmod(0o755)
    log = tmp_path / "calls.log"
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "STUB_LOG": str(log), "STUB_INDEX": index,
           "STUB_PIP_FAILS": fails, "CUDA_VISIBLE_DEVICES": None}
    res = run(["make", "--no-print-directory", "setup", f"PYTHON={bin_dir / 'python3'}", *filter(None, [asked])],
              cwd=folder, env=env, expect_rc=None, timeout=60)
    pips = [line for line in log.read_text().splitlines() if line.startswith("-m pip install")]
    if build == "failed":
        assert res.returncode != 0 and not (folder / ".venv").exists(), res.tail()
        errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
        assert errors == ["error: the install into .venv failed (its message is above); .venv was removed, so "
                          "nothing is left half-installed: run make again once that is fixed"], res.stderr
        return
    assert res.returncode == 0 and (folder / ".venv/.installed").exists(), res.tail()
    assert any("-r requirements-dev.txt -c requirements-dev.lock" in p for p in pips), pips
    assert any(p.endswith(CPU_INDEX) for p in pips) == (build == "cpu"), pips
    if build == "cpu":
        assert pips[0].endswith(CPU_INDEX), "the CPU build first: the rest then finds torch installed"
    notes = [line for line in res.stdout.splitlines() if line.startswith("note: ")]
    assert len(notes) == (build == "cuda-note"), res.stdout
    if notes:
        assert "cannot be reached" in notes[0] and "make distclean setup" in notes[0], notes


FIND_SPEC = r"""
import importlib.util, sys
for folder in sys.argv[1:]:  # what `python FOLDER/script.py` finds: sys.path[0] is the script's folder
    sys.path[0] = folder
    importlib.invalidate_caches()
    print(folder, *(getattr(importlib.util.find_spec(n), "origin", None) for n in ("common", "workarounds", "tools")))
"""


BARE_HELP = r"""
import contextlib, io, json, os, runpy, sys
sys.path.remove("")  # `python -c` puts the working folder (the root) first; `python SCRIPT` does not
import torch  # kept between the scripts; the course's own modules are imported anew by each
before, results, path = set(sys.modules), [], list(sys.path)
for script in sys.argv[1:]:
    for name in set(sys.modules) - before:  # the course's modules and the scripts', not torch's
        where = getattr(sys.modules[name], "__file__", None) or ""
        if where.startswith(os.getcwd() + os.sep) and "site-packages" not in where:
            del sys.modules[name]
    out = io.StringIO()
    sys.argv, sys.path[:] = [script, "--help"], [os.path.dirname(os.path.abspath(script)), *path]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code
    except Exception as err:  # noqa: BLE001 - what a user would see instead of the help
        code = f"{type(err).__name__}: {err}"
    results.append([script, code, "usage: " in out.getvalue(), out.getvalue()[:300]])
print(json.dumps(results))
"""


def test_every_course_tool_answers_help_from_the_root_with_an_interpreter_without_the_course(bare):
    """docs and docstrings show `python bench/NAME.py ...` and `python tools/NAME.py ...` run from the course's root:
    with an interpreter that holds torch and not the course (a GPU host's python3, PY=python3), each finds the
    course's modules by itself and answers --help."""
    scripts = sorted(str(p.relative_to(REPO)) for folder in ("bench", "tools") for p in (REPO / folder).glob("*.py")
                     if "__main__" in p.read_text())
    assert len(scripts) >= 15 and "bench/gpu_check.py" in scripts and "tools/tracecheck.py" in scripts, scripts
    res = run([bare, "-c", BARE_HELP, *scripts], env=BARE_ENV, timeout=180)
    for script, code, usage, out in json.loads(res.stdout):
        assert code == 0 and usage, (script, code, out)
    # the lesson's scripts stay free of path tricks: they find common.py through PYTHONPATH (docs/setup.md), as make
    # gives it to every process it starts
    lessons = sorted(str(p.relative_to(REPO)) for p in REPO.glob("0[1-9]_*/*.py") if "argparse" in p.read_text())
    res = run([bare, "-c", BARE_HELP, *lessons], env={"PYTHONPATH": str(REPO)}, timeout=180)
    for script, code, usage, out in json.loads(res.stdout):
        assert code == 0 and usage, (script, code, out)
    assert len(lessons) >= 25


def test_common_imports_from_every_numbered_folder_without_pythonpath(tmp_path):
    """In the course's .venv (its editable install) a script run by hand finds common.py from every numbered
    folder; an interpreter without the course installed does not, which is why the Makefile exports PYTHONPATH."""
    folders = sorted(str(f) for f in REPO.glob("0*_*"))
    res = run([PYTHON, "-c", FIND_SPEC, *folders], cwd=tmp_path, env={"PYTHONPATH": None})
    installed = Path(sys.prefix) == REPO / ".venv"
    found = (f"{REPO / 'common.py'} {REPO / 'workarounds.py'} {REPO / 'tools' / '__init__.py'}" if installed
             else "None None None")
    assert res.stdout.splitlines() == [f"{folder} {found}" for folder in folders] and len(folders) >= 6


def test_the_rendezvous_store_listens_on_every_interface():
    import torch.distributed as dist

    import common

    port = common.free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False)
    try:
        listening = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for row in Path(table).read_text().splitlines()[1:]:
                local, state = row.split()[1], row.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    listening.add(address)
        assert listening and all(set(a) == {"0"} for a in listening), listening  # 0.0.0.0 or ::, not 127.0.0.1
    finally:
        del store


def test_gpu_check_lists_its_plan_for_a_machine_with_two_gpus():
    out = python("bench/gpu_check.py", "--list", "--gpus", "2", "--cores", "16").stdout
    assert "ddp-torchrun" in out and re.search(r"^  allreduce-busbw\s+make .*bench-allreduce NPROC=2", out, re.M), out
    assert re.search(r"^then \d+ streams side by side", out, re.M) and re.search(r"^targets-1: ", out, re.M), out


def test_every_line_about_distribution_is_marked_in_the_training_scripts():
    """The README's house style: a `# DDP:` (or `# DP:`, `# AMP:`, `# SyncBN:`) comment on the line, or on the
    comment lines just above the statement, for every distributed call in the training scripts."""
    call = re.compile(r"\bdist\.\w+\(|\bDDP\(|DistributedSampler\(|\.set_epoch\(|nn\.DataParallel\(")
    marker = re.compile(r"# (DDP|DP|AMP|SyncBN):")
    unmarked = []
    for script in ("01_dataparallel/mnist_dataparallel.py", "02_ddp_spawn/mnist_spawn.py",
                   "03_ddp_torchrun/mnist_torchrun.py", "04_multinode_tcp/mnist_tcp.py",
                   "06_amp_syncbn/mnist_amp_syncbn.py", "06_amp_syncbn/cifar_resnet.py"):
        lines = (REPO / script).read_text().splitlines()
        for i, text in enumerate(lines):
            if text.strip().startswith("#") or not call.search(text):
                continue
            end = i  # the statement's own lines: until its brackets close
            while sum(lines[k].count("(") - lines[k].count(")") for k in range(i, end + 1)) > 0:
                end += 1
            above = i - 1  # the comment lines just above it, and a block header (`for ...:`, `try:`) above those
            while above >= 0 and lines[above].strip().startswith("#"):
                above -= 1
            header = [lines[above]] if above >= 0 and lines[above].split("#")[0].rstrip().endswith(":") else []
            if not any(marker.search(t) for t in lines[above + 1:end + 1] + header):
                unmarked.append(f"{script}:{i + 1}: {text.strip()}")
    assert not unmarked, "\n".join(unmarked)


@pytest.mark.slow
def test_the_harness_fails_a_command_that_leaves_a_process_behind_and_stops_it():
    with pytest.raises(AssertionError, match="processes left behind"):
        run(["bash", "-c", "sleep 297 >/dev/null 2>&1 & echo started"], timeout=30, linger=1)
    alive, deadline = ["?"], time.time() + 5  # SIGKILL is not instant: allow the kernel a moment
    while alive and time.time() < deadline:
        time.sleep(0.1)
        alive = []
        for entry in Path("/proc").glob("[0-9]*"):
            try:
                if (entry / "cmdline").read_bytes() == b"sleep\x00297\x00":
                    alive.append(entry.name)
            except OSError:
                pass
    assert not alive, f"the leftover was not stopped: {alive}"


def test_what_make_starts_prints_each_line_as_it_comes():
    """Output to a file or a pipe is block-buffered unless PYTHONUNBUFFERED is set: the Makefile sets it."""
    probe = "buffering-probe: ; @$(PY) -c 'import sys; print(sys.stdout.write_through)'"
    result = make("--eval", probe, "buffering-probe", env={"PYTHONUNBUFFERED": ""},
                  timeout=60)  # empty: as if the tests did not set it
    assert result.stdout.split() == ["True"], result.stdout


def test_what_the_tests_start_waits_passively_in_openmp():
    """Two tests share the cores: OpenMP threads spinning while they wait would burn the other test's core."""
    result = run([PYTHON, "-c", "import os; print(os.environ.get('OMP_WAIT_POLICY'))"], timeout=30)
    assert result.stdout.split() == ["PASSIVE"], result.stdout


def dry_run(tmp_path, gpus: int, *make_args, visible: str | None = None) -> str:
    """What make would run on a machine whose nvidia-smi -L lists `gpus` GPUs."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\n" + "".join(f"echo 'GPU {i}: NVIDIA H100 (UUID: GPU-{i})'\n" for i in range(gpus)))
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", *OUTER_MAKE)}
    env["PATH"] = f"{tmp_path}:{env['PATH']}"
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return subprocess.run(["make", "-n", *make_args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60).stdout


def test_the_preflight_runs_a_checked_command_in_itself_or_execs_it(monkeypatch, tmp_path, capsys):
    """--run: `python -m module` and `python script.py` run in the preflight's own process, as Python would run
    them; another interpreter, interpreter options, or a GPU the checks touched replace the process instead."""
    import argparse
    import runpy
    import sys

    from tools import preflight

    calls = []
    monkeypatch.setattr(runpy, "run_module", lambda name, **kw: calls.append(("module", name, kw, list(sys.argv))))
    monkeypatch.setattr(runpy, "run_path", lambda path, **kw: calls.append(("path", path, kw, list(sys.argv))))

    class Replaced(Exception):  # os.execvp does not return
        pass

    def execvp(file, argv):
        calls.append(("exec", file, argv))
        raise Replaced

    monkeypatch.setattr(preflight.os, "execvp", execvp)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(argparse.ArgumentParser, "error", lambda self, message: None)  # as the checks leave it
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # on a GPU machine the conftest touched CUDA
    script = str(tmp_path / "train.py")
    preflight.run_here([sys.executable, "-m", "torch.distributed.run", "--standalone", script, "--lr", "0.1"])
    assert calls.pop() == ("module", "torch.distributed.run", {"run_name": "__main__", "alter_sys": True},
                           ["torch.distributed.run", "--standalone", script, "--lr", "0.1"])
    assert sys.path[0] == os.getcwd() and argparse.ArgumentParser.error is preflight._ERROR
    preflight.run_here([sys.executable, script, "--note", "a b"])
    assert calls.pop() == ("path", script, {"run_name": "__main__"}, [script, "--note", "a b"])
    assert sys.path[0] == str(tmp_path)
    assert capsys.readouterr().out.splitlines()[-1] == f"{sys.executable} {script} --note 'a b'"
    for command, gpu in ((["/usr/bin/other-python", script], False), ([sys.executable, "-u", script], False),
                         ([sys.executable, script], True)):  # the last: a launcher must not hold a GPU
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda gpu=gpu: gpu)
        with pytest.raises(Replaced):
            preflight.run_here(command)
        assert calls.pop() == ("exec", command[0], command)


@pytest.mark.parametrize("target, launcher, script", [
    ("ddp-torchrun", "-m torch.distributed.run --standalone ", "mnist_torchrun.py"),
    ("amp-syncbn", "-m torch.distributed.run --standalone ", "mnist_amp_syncbn.py"),
    ("launch-legacy", "-m torch.distributed.launch ", "mnist_torchrun.py"),
    ("ddp-spawn", "", "mnist_spawn.py"), ("smoke", "", "mnist_single.py"),
    ("dataparallel", "", "mnist_dataparallel.py"),
    ("cifar-resnet", "-m torch.distributed.run --standalone ", "cifar_resnet.py")],
    ids=["ddp-torchrun", "amp-syncbn", "launch-legacy", "ddp-spawn", "smoke", "dataparallel", "cifar-resnet"])
def test_a_launch_target_checks_and_launches_from_one_process(tmp_path, target, launcher, script):
    """make starts one process for the launch: the preflight, which runs the command after --run in itself."""
    lines = [line for line in dry_run(tmp_path, 0, target).splitlines() if script in line]
    assert len(lines) == 1, lines
    assert re.search(rf"tools/preflight\.py (--nproc 2 )?--run \S*python\S* {launcher}.*{script}", lines[0]), lines


@pytest.mark.parametrize("gpus, visible, expected", [(0, None, 2), (1, None, 2), (3, None, 3), (3, "0", 1 + 1),
                                                     (3, "", 2)])
def test_nproc_defaults_to_one_process_per_gpu_and_to_2_with_fewer_gpus(tmp_path, gpus, visible, expected):
    """Targets compare ranks: never fewer than 2 processes, also on a machine with one GPU."""
    dry = dry_run(tmp_path, gpus, "ddp-torchrun", visible=visible)
    assert f"--nproc-per-node {expected} " in dry, dry


@pytest.mark.parametrize("gpus, args, per_node", [(0, [], 2), (1, [], 2), (2, [], 1), (8, [], 4), (8, ["NNODES=4"], 2),
                                                  (8, ["NPROC=3"], 3)])
def test_simulated_nodes_share_the_gpus_unless_nproc_is_given(tmp_path, gpus, args, per_node):
    """NNODES nodes on one machine: GPUS / NNODES processes each, so every process gets a GPU of its own."""
    nnodes = 4 if "NNODES=4" in args else 2
    assert f"launch_local.sh tcp {nnodes} {per_node} " in dry_run(tmp_path, gpus, "multinode-tcp", *args)
    if nnodes == 2:
        assert f"launch_torchrun_nodes.sh static 2 {per_node} " in dry_run(tmp_path, gpus, "multinode-torchrun", *args)
        assert f"netns_2hosts.sh {per_node} " in dry_run(tmp_path, gpus, "multinode-netns", *args)


def test_every_script_answers_help_with_a_whole_sentence_or_says_how_to_start_it():
    scripts = sorted(p.relative_to(REPO) for p in [*REPO.glob("0*_*/*.py"), *REPO.glob("bench/*.py"),
                                                   *REPO.glob("tools/*.py")]
                     if '__name__ == "__main__"' in p.read_text())  # scripts, not modules
    answers = exits([(script, ["--help"]) for script in scripts])
    assert len(answers) == len(scripts) > 30
    for name, (code, text, _) in zip(scripts, answers, strict=True):
        assert code == 0 and "Traceback" not in text, (name, code)
        words = text.split("\n\n")[1 if text.startswith("usage:") else 0].split()
        assert words and words[-1].endswith((".", "?", ")")), f"{name}: the help's description stops mid-sentence"
    minimal = answers[scripts.index(Path("03_ddp_torchrun/elastic_ddp.py"))][1]
    assert "torchrun --standalone --nproc-per-node 2 03_ddp_torchrun/elastic_ddp.py" in " ".join(minimal.split())


def test_the_quick_tests_go_beside_the_ranks_tests_and_at_the_end():
    """conftest hands the tests that start processes out first; the quick ones go right after each test marked
    ranks(n) (the other worker runs them while it holds the cores alone) and at the end (they fill the gaps)."""
    from harness import KINDS

    assert {"starts", "quick"} <= set(KINDS)  # and "ranks" where the collected files hold such tests (make test)
    last = max(i for i, k in enumerate(KINDS) if k != "quick")
    assert KINDS[last + 1:] and set(KINDS[last + 1:]) == {"quick"}
    for i in range(1, last):  # each block of quick tests before the end follows a test marked ranks(n)
        if KINDS[i] == "quick" and KINDS[i - 1] != "quick":
            assert KINDS[i - 1] == "ranks", (i, KINDS[i - 1])
    if "ranks" in KINDS:
        assert max(i for i, k in enumerate(KINDS) if k == "ranks") < KINDS.index("starts"), "ranks(n) come first"


def test_the_tests_that_mostly_wait_are_handed_out_apart():
    """Two tests marked waits side by side would leave both cores idle: conftest spreads them out among the other
    tests that start processes, in this run's order and in a made-up one."""
    from harness import WAITS, hand_out_order

    class Item:
        def __init__(self, name, *marks, suffix=".py"):
            self.name, self.marks, self.path = name, marks, Path(f"{name}{suffix}")

        def get_closest_marker(self, mark):
            return mark if mark in self.marks else None

    items = [Item(f"b{i}", "slow") for i in range(6)] + [Item("s0", "slow", "skip"), Item("nb", suffix=".ipynb")] \
        + [Item(f"w{i}", "slow", "waits") for i in range(3)] + [Item(f"r{i}", "slow", "ranks") for i in range(2)] \
        + [Item("l0", "slow", "long")] + [Item(f"q{i}") for i in range(7)]
    hand_out_order(items)  # notebooks, ranks(n) each with 2 quick ones, long, the rest; skipped, the quick left
    assert [item.name for item in items] == ["nb", "r0", "q0", "q1", "r1", "q2", "q3", "w0", "l0", "b0", "b1", "w1",
                                             "b2", "b3", "w2", "b4", "b5", "s0", "q4", "q5", "q6"]
    items = [Item(f"r{i}", "slow", "ranks") for i in range(2)] + [Item(f"q{i}") for i in range(12)]
    hand_out_order(items)  # 5/6 of 12 quick tests: 5 beside each, 2 left for the end
    assert [item.name for item in items] == ["r0", *[f"q{i}" for i in range(5)], "r1", *[f"q{i}" for i in range(5, 12)]]
    places = [i for i, waits in enumerate(WAITS) if waits]
    assert all(b - a >= 3 for a, b in zip(places, places[1:], strict=False)), places


def test_gpu_tests_are_marked_and_skipped_where_there_is_no_gpu():
    """Every test marked `cuda` or `multigpu` is skipped, with its reason, on a machine without a GPU (here: CUDA
    hidden), and none of them passes or fails there. The unmarked tests run on the CPU in every `make test`."""
    marked = sum(len(re.findall(r"^@pytest\.mark\.(?:cuda|multigpu)$", p.read_text(), re.M))
                 for p in (REPO / "tests").glob("test_*.py"))
    res = subprocess.run([PYTHON, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:nbval", "-m",
                          "cuda or multigpu", "tests"], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")},
                              "CUDA_VISIBLE_DEVICES": ""})
    summary = res.stdout.strip().splitlines()[-1]
    notebooks = importlib.util.find_spec("jupytext") is None  # make test PY=...: test_notebooks skips itself whole
    expected = rf"^{marked + notebooks} skipped, \d+ deselected(, \d+ warnings?)? in "
    assert re.match(expected, summary), res.stdout[-2000:]
    reasons = re.findall(r"^SKIPPED \[(\d+)\] \S+: needs ([12]) usable CUDA GPU\(s\); this machine has 0$", res.stdout,
                         re.M)
    assert sum(int(n) for n, _ in reasons) == marked, res.stdout[-2000:]


@pytest.mark.slow
def test_the_progress_bar_is_drawn_on_a_terminal_only_and_by_rank_0_only(data_dir):
    """tqdm(disable=None) draws on a terminal (and stays silent in a pipe: the smoke test's run); the other ranks
    pass True."""
    import pty

    cmd = [PYTHON, REPO / "01_dataparallel/mnist_single.py", "--dataset", "mnist-standin", "--data-dir", data_dir,
           "--epochs", "1", "--max-steps", "3"]
    import fcntl
    import struct
    import termios

    leader, follower = pty.openpty()  # standard error a terminal, as in a shell, 100 columns wide (tqdm fits them)
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.run([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=follower, timeout=120, cwd=REPO,
                          env={k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"})
    os.close(follower)
    drawn = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:
            break
        if not chunk:
            break
        drawn += chunk
    os.close(leader)
    assert proc.returncode == 0 and b"epoch 1:" in drawn and b"it/s" in drawn, drawn[-500:]
    for script in ("02_ddp_spawn/mnist_spawn.py", "03_ddp_torchrun/mnist_torchrun.py", "04_multinode_tcp/mnist_tcp.py",
                   "06_amp_syncbn/mnist_amp_syncbn.py"):
        assert "disable=None if rank == 0 else True" in (REPO / script).read_text(), script


def test_no_function_of_the_machinery_is_called_only_by_its_own_tests():
    """Rot: every public function and class of common.py, workarounds.py, tools/ and bench/benchlib.py is used by
    something other than the tests (a script, a tool, the Makefile, a notebook), or it goes."""
    import ast

    modules = [REPO / "common.py", REPO / "workarounds.py", REPO / "bench/benchlib.py",
               *sorted((REPO / "tools").glob("*.py"))]
    users = [p for p in REPO.rglob("*.py") if not any(part.startswith(".") or part in ("tests", "data", "runs")
                                                      for part in p.relative_to(REPO).parts[:-1])]
    texts = {p: p.read_text() for p in users} | {REPO / "Makefile": (REPO / "Makefile").read_text()}
    unused = []
    for module in modules:
        tree = ast.parse(module.read_text())
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                word = re.compile(rf"\b{re.escape(node.name)}\b")
                own = len(word.findall(texts[module]))
                if own < 2 and not any(word.search(text) for path, text in texts.items() if path != module):
                    unused.append(f"{module.relative_to(REPO)}:{node.name}")
    assert not unused, unused
