"""The foundation as a user meets it: make targets, the baseline run, copying a script, the diff tool."""

import re
import shutil

import pytest

from harness import PYTHON, REPO, make, python, run


@pytest.mark.slow
def test_make_smoke_trains_the_baseline(data_dir):
    res = make("smoke", f"ARGS=--data-dir {data_dir}", timeout=300)
    final = res.final
    assert final["world_size"] == 1 and final["epochs"] == 1 and final["dataset"] == "mnist-standin"
    assert final["test_samples"] == 4000
    assert 0.9 < final["test_acc"] < 1.0, "one epoch should learn the stand-in well, but not perfectly"


@pytest.mark.slow
def test_script_runs_from_a_folder_holding_only_itself_and_common(tmp_path, data_dir):
    for name in ("01_dataparallel/mnist_single.py", "common.py"):
        shutil.copy(REPO / name, tmp_path)
    with open(tmp_path / "common.py", "a") as f:  # prove that the copy, not the repo's common.py, is used
        f.write("\nprint('common.py from the copy', flush=True)\n")
    res = run([PYTHON, "mnist_single.py", "--dataset", "mnist-standin", "--data-dir", data_dir,
               "--epochs", "1", "--max-steps", "20", "--checkpoint-dir", tmp_path / "ck"], cwd=tmp_path)
    assert res.final["test_samples"] == 4000
    assert res.stdout.startswith("common.py from the copy")
    assert (tmp_path / "ck" / "mnist_single.pt").exists()


def test_bad_input_is_one_line_not_a_traceback(tmp_path):
    res = python("01_dataparallel/mnist_single.py", "--dataset", "imagenet", expect_rc=2)
    assert "invalid choice: 'imagenet'" in res.stderr and "Traceback" not in res.stderr
    # every download goes to a proxy that is not there: offline, whether this machine has internet or not
    dead_proxy = {"https_proxy": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9", "no_proxy": "",
                  "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9", "NO_PROXY": ""}
    res = python("01_dataparallel/mnist_single.py", "--dataset", "mnist", "--data-dir", tmp_path / "empty",
                 env=dead_proxy, expect_rc=2)
    assert "make data" in res.stderr and "Traceback" not in res.stderr


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


def test_ci_runs_the_readme_test_command():
    ci = (REPO / ".ci" / "run").read_text()
    readme = (REPO / "README.md").read_text()
    assert re.search(r"^make test$", ci, re.M), "CI runs exactly `make test`"
    assert re.search(r"^make test +#", readme, re.M), "the README's test command is `make test`"
