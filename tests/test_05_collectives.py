"""Section 05: point-to-point and collective communication, exact evaluation, hangs made visible."""

import ast
import math
import os
import re
import subprocess
import sys
import types
import zlib
from functools import reduce

import pytest
import torch

import common
from harness import BARE_ENV, PYTHON, REPO, gloo_has_list_all_to_all, in_fork, make, run

# Gloo on CPU, as recorded in the project's measured facts: every op of the static table works
# (reduce_scatter and all_to_all too, unlike the table); these fail.
GLOO_CPU_FAILS = {("all_reduce AVG", "int64"), ("all_reduce BAND", "float32"), ("all_reduce BAND", "float16"),
                  ("all_gather, uneven sizes", "float32"), ("all_gather, uneven sizes", "float16"),
                  ("all_gather, uneven sizes", "int64")}


def first_line(out: str) -> str:
    """The first line a script printed, after make's echo of the command that started it (and of the echo's indented
    continuation), the device policy's NOTE (a run that leaves GPUs unused says so first) left out."""
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if "torch.distributed.run" in ln) + 1
    return next(ln for ln in lines[start:] if ln.strip() and not ln.startswith((" ", "NOTE: ")))


def rank_tables(out: str) -> dict[str, list[tuple]]:
    """Every table the script printed, title -> [(before, after) of rank 0, 1, ...]: a title line (collectives.py
    adds its own verdict in brackets, dropped here) followed by one `    rank r: BEFORE -> AFTER` line per rank. A
    value is read as a Python literal ([1.0, 2.0], {'epoch': 3}), or kept as the text it is (host-of-0)."""

    def value(text):
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError):
            return text

    found = {}
    for title, block in re.findall(r"^(\S.*)\n((?:    rank \d+: .*(?:\n|$))+)", out, re.M):
        rows = [re.fullmatch(r"    rank (\d+): (.*?)\s+-> (.*)", line).groups() for line in block.splitlines()]
        assert [int(r) for r, _, _ in rows] == list(range(len(rows))), block
        found[re.sub(r"  \[[^\]]*\]$", "", title)] = [(value(b), value(a)) for _, b, a in rows]
    return found


REDUCE = {"SUM": sum, "PRODUCT": math.prod, "MIN": min, "MAX": max, "AVG": lambda v: sum(v) / len(v),
          "BAND": lambda v: reduce(lambda a, b: a & b, v), "BOR": lambda v: reduce(lambda a, b: a | b, v),
          "BXOR": lambda v: reduce(lambda a, b: a ^ b, v)}


def expected_after(title: str, before: list) -> list:
    """What every rank must hold after the op, from the op's definition and every rank's printed input."""
    n = len(before)
    op = title.split("(")[0]
    if op == "broadcast" or op == "broadcast_object_list":
        return [before[0]] * n
    if op == "reduce":  # only rank 0's result is specified: elementwise sum of every rank's tensor
        return [[sum(col) for col in zip(*before, strict=True)]] + [None] * (n - 1)
    if op == "all_reduce":
        fn = REDUCE[title.split("(")[1].split(",")[0]]
        return [[fn([b[0] for b in before])]] * n
    if op == "gather":
        return [before] + ["(nothing)"] * (n - 1)
    if op == "all_gather":
        return [before] * n
    if op == "all_gather_single":
        return [[v for b in before for v in b]] * n
    if op == "scatter":
        return [before[0][r] for r in range(n)]
    if op == "reduce_scatter":  # rank j: the sum of every rank's piece j
        return [[sum(before[r][j][0] for r in range(n))] for j in range(n)]
    if op == "reduce_scatter_single":
        return [[sum(before[r][j] for r in range(n))] for j in range(n)]
    if op in ("all_to_all", "all_to_all_single"):  # a transpose: rank j gets piece j of every rank
        return [[before[r][j] for r in range(n)] for j in range(n)]
    if op == "barrier":
        return ["passed"] * n
    if op == "all_gather_object":
        return ["[" + ", ".join(before) + "]"] * n
    if op == "scatter_object_list":  # rank 0's list, printed as [job for 0, job for 1, ...]
        return before[0][1:-1].split(", ")
    raise AssertionError(f"no closed form for {title}")


def close(got, want) -> bool:
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(close, got, want))
    if isinstance(want, (int, float)) and isinstance(got, (int, float)):
        return math.isclose(got, want, rel_tol=1e-6)
    return got == want


def check_collectives(out: str, nproc: int, backend: str):
    assert first_line(out).startswith(f"{nproc} ranks, backend {backend}, device "), out
    tables = rank_tables(out)
    # broadcast, reduce, 8 all_reduce ops, 9 other tensor ops, barrier, 3 object ops; NCCL has no bitwise reductions
    bitwise = re.findall(r"^all_reduce\((BAND|BOR|BXOR)\)  \[not supported by nccl: not run\]$", out, re.M)
    # Gloo's list form of all_to_all came after torch 2.11: where this torch refuses it, the script says so
    lacks = backend == "gloo" and not gloo_has_list_all_to_all()
    assert (len(tables), len(bitwise)) == ((22 - lacks, 0) if backend == "gloo" else (19, 3)), sorted(tables)
    said = re.findall(r"^all_to_all  \[not supported by gloo in torch \S+: not run\]$", out, re.M)
    assert len(said) == lacks and ("all_to_all" in tables) != lacks, (lacks, said)
    for title, rows in tables.items():
        before, after = [b for b, _ in rows], [a for _, a in rows]
        assert len(rows) == nproc, (title, rows)
        if title.split("(")[0] in ("broadcast", "reduce", "all_reduce", "gather", "all_gather", "all_gather_single",
                                   "reduce_scatter", "reduce_scatter_single", "all_to_all", "all_to_all_single"):
            assert len({str(b) for b in before}) == nproc, ("every rank puts in something else", title, before)
        want = expected_after(title, before)
        for r in range(nproc):
            if want[r] is not None:  # None: reduce's other ranks, which PyTorch leaves unspecified
                assert close(after[r], want[r]), (title, r, after[r], want[r])
    # and the script's own check, which a learner reads, agrees
    assert "result: all collectives correct" in out and "[WRONG]" not in out


@pytest.mark.slow  # 3 processes, none of them training: no ranks mark, they share the cores as 2 training ones do
@pytest.mark.parametrize("nproc", [3])  # an odd world size; notebook 05 checks NPROC=4 the same way
def test_every_collective_gives_its_closed_form_result(nproc, bare):
    # bare: an interpreter without the course installed; torchrun's workers import tools/ all the same
    out = make("collectives", f"NPROC={nproc}", f"PY={bare}", env=BARE_ENV, timeout=120).stdout
    check_collectives(out, nproc, common.device_and_backend(procs_per_node=nproc)[1])
    # the table shows every rank: the last all_to_all_single row of the last rank
    last = nproc - 1
    assert f"rank {last}: {[float(10 * last + j) for j in range(nproc)]}" in out


@pytest.mark.slow
@pytest.mark.multigpu
def test_every_collective_on_nccl():
    out = make("collectives", "NPROC=2", "BACKEND=nccl", timeout=120).stdout
    check_collectives(out, 2, "nccl")


@pytest.mark.slow  # 3 processes, none of them training: no ranks mark, they share the cores as 2 training ones do
def test_point_to_point_and_the_ring():
    out = make("p2p", "NPROC=3", timeout=120).stdout
    assert first_line(out).startswith("3 ranks, backend "), out  # the backend it chose, first
    tables = list(rank_tables(out).values())  # send/recv, isend/irecv, the ring: what each rank held before, after
    assert len(tables) == 3 and all(len(rows) == 3 for rows in tables), out
    for rows in tables[:2]:  # rank 0 adds 100 and sends it to rank 1; rank 2 takes no part
        (b0, a0), (_, a1), (b2, a2) = rows
        assert a0 == a1 == [b0[0] + 100] and a2 == b2, rows
    sent = [b for b, _ in tables[2]]
    assert len({s[0] for s in sent}) == 3, sent  # a different value on every rank
    assert [a for _, a in tables[2]] == [sent[(r - 1) % 3] for r in range(3)], tables[2]  # rank r gets rank r - 1's
    assert "result: ring correct" in out  # and the script's own check agrees
    # rank 0's isend, asked without blocking before wait() and after it; Gloo marks it done only inside wait()
    polled = re.search(r"^    rank 0's request: is_completed\(\) (True|False) before wait\(\), (True|False) after$",
                       out, re.M)
    assert polled and polled[2] == "True", out
    if "backend gloo" in first_line(out):
        assert polled[1] == "False", out


def test_ucc_is_a_backend_for_cpu_and_cuda_tensors_that_the_installed_wheel_lacks():
    """README, Backends: torch names `ucc` (CPU and CUDA tensors), but the pinned wheel is built without it, as
    without MPI: a group asked for it fails at once."""
    import torch.distributed as dist

    assert dist.Backend.UCC == "ucc" and dist.Backend.backend_capability["ucc"] == ["cpu", "cuda"]
    assert not dist.is_ucc_available() and not dist.is_mpi_available()
    # torch 2.14.1's words; torch 2.11 refuses it earlier, as a backend type it does not know
    with pytest.raises((RuntimeError, AssertionError),
                       match="Distributed package doesn't have UCC built in|Unknown c10d backend type UCC"):
        dist.init_process_group("ucc", store=dist.HashStore(), rank=0, world_size=1)
    assert not dist.is_initialized()


def test_a_gloo_send_or_receive_is_completed_only_by_wait():
    """README: with Gloo, is_completed() of an isend or irecv stays False until wait() has run, even with the data
    already in the receive buffer. Two Gloo groups of one job (ranks 0 and 1) in two threads of this process."""
    import time

    groups = _gloo_pair()
    sent, received = torch.tensor([100.0]), torch.zeros(1)
    send, recv = groups[0].send([sent], 1, 0), groups[1].recv([received], 0, 0)
    deadline = time.time() + 30
    while received.item() != 100.0 and time.time() < deadline:
        time.sleep(0.01)
    assert received.item() == 100.0, "the data arrives without wait()"
    time.sleep(0.5)  # time enough for a request that completes by itself to say so
    assert not send.is_completed() and not recv.is_completed()
    send.wait()
    recv.wait()
    assert send.is_completed() and recv.is_completed()


def test_a_tensor_dropped_after_a_gloo_collective_lives_on_in_its_work_and_goes_with_it():
    """README: a tensor handed to a Gloo collective and then dropped by Python stays alive, the same Python object,
    as long as the collective's work holds it: whoever lets go of the work last (a Gloo thread, say) frees a Python
    object. A one-rank Gloo group in this process."""
    import datetime
    import gc
    import time
    import weakref

    import torch.distributed as dist

    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=10))
    tensor = torch.ones(3)
    alive = weakref.ref(tensor)
    work = group.allreduce([tensor])
    work.wait()
    del tensor
    gc.collect()
    assert alive() is not None, "dropped by Python, yet alive: the work holds it"
    del work
    deadline = time.time() + 10
    while alive() is not None and time.time() < deadline:  # Gloo's thread may still hold the work for a moment
        gc.collect()
        time.sleep(0.01)
    assert alive() is None, "freed once the work is"


def _gloo_pair():
    """Two Gloo groups of one job (ranks 0 and 1), made in two threads of this process."""
    import datetime
    import threading

    import torch.distributed as dist

    store, groups = dist.HashStore(), {}

    def join(rank):  # both ranks must connect at once
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=30))

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return groups


@pytest.mark.parametrize("last", ["barrier", "monitored_barrier"])
def test_a_gloo_barrier_keeps_the_collectives_in_flight_until_its_own_work_goes(last):
    """README (why a finished Gloo job can abort at exit): rank 0 starts an all_reduce that rank 1 has not joined
    yet, drops the tensor and the work, then syncs. After barrier(), the tensor is still alive, held through the
    barrier's work, until that work goes (in a script, a Gloo thread frees it after barrier() returns);
    monitored_barrier() holds nothing, and the tensor goes as soon as the all_reduce is done."""
    import datetime
    import gc
    import threading
    import time
    import weakref

    groups, go, timeout = _gloo_pair(), threading.Event(), datetime.timedelta(seconds=30)

    def rank1():
        go.wait(30)
        groups[1].allreduce([torch.ones(3)]).wait()
        groups[1].barrier().wait() if last == "barrier" else groups[1].monitored_barrier(timeout, True)

    helper = threading.Thread(target=rank1)
    helper.start()
    tensor = torch.ones(3)
    alive = weakref.ref(tensor)
    groups[0].allreduce([tensor])  # in flight: rank 1 waits for `go`; the work is dropped at once
    del tensor
    if last == "barrier":
        work = groups[0].barrier()  # started while the all_reduce is in flight
        go.set()
        work.wait()
    else:
        go.set()
        groups[0].monitored_barrier(timeout, True)
        work = None
    helper.join(30)
    time.sleep(0.3)  # time enough for Gloo's threads to let go of what they ran
    gc.collect()
    assert (alive() is not None) == (last == "barrier"), "barrier() keeps it, monitored_barrier() does not"
    del work
    deadline = time.time() + 10
    while alive() is not None and time.time() < deadline:
        time.sleep(0.01)
        gc.collect()
    assert alive() is None, "it goes with the barrier's work"


@pytest.mark.slow
@pytest.mark.ranks(3)
def test_exact_evaluation_vs_the_padded_count_in_a_finished_three_rank_job(tmp_path, monkeypatch, capsys):
    """`make exit-stress` runs `make ddp-eval NPROC=3 ARGS="--subset 10"`'s command (bench/stress.py exit, called
    here as that target calls it, once and on one side: both sides run alike now, and tests/test_bench.py shows the
    sides alternate; in a folder the test keeps): it finishes, and the evaluation's numbers are recomputed from the
    model the script left."""
    import json

    from harness import OUTER_MAKE, stress_in_process

    n, ws = 10, 3
    env = {k: v for k, v in os.environ.items() if k not in OUTER_MAKE}
    dry = ["make", "-n", "--no-print-directory"]
    recipe = subprocess.run([*dry, "exit-stress", "RUNS=1", "BENCH_OUT=out"], cwd=REPO, capture_output=True,
                            text=True, timeout=60, env=env).stdout
    assert re.search(r"\S*python\S* bench/stress\.py exit --runs 1 --output-dir out\s*$", recipe), recipe
    plain = subprocess.run([*dry, "ddp-eval", f"NPROC={ws}", f"ARGS=--subset {n}"], cwd=REPO, capture_output=True,
                           text=True, timeout=60, env=env).stdout
    assert re.search(rf"-m torch\.distributed\.run --standalone --local-addr 127\.0\.0\.1 --nproc-per-node {ws} "
                     rf"05_collectives/distributed_eval\.py --subset {n}\s*$", plain), plain  # what stress.py runs
    code, shown, work = stress_in_process(["exit", "--runs", "1", "--sides", "on", "--show"], tmp_path, monkeypatch,
                                          capsys)
    assert code == 0, shown[-4000:]
    record = json.loads(next(tmp_path.glob("stress_exit_*.json")).read_text())
    assert record["runs"] == 1 and [r["workaround"] for r in record["per_run"]] == [True]
    assert record["passed_with_workaround"] == 1 and record["passed_without_workaround"] is None, record["per_run"]
    out = shown[:shown.index("run 1/1, workaround on ")]  # the run's output
    data_dir = work / "data"
    # the same numbers, recomputed here from the model the script left: one process, image by image
    model = common.ConvNet()
    model.load_state_dict(torch.load(data_dir / "standin" / "distributed_eval_model.pt", weights_only=True))
    model.eval()
    test = common.load_dataset("mnist-standin", data_dir, train=False)
    with torch.no_grad():
        predicted = [int(model(test[i][0][None]).argmax(1).item()) for i in range(n)]
    truth = [int(test[i][1]) for i in range(n)]
    right = [int(p == t) for p, t in zip(predicted, truth, strict=True)]
    ious = []  # per class that occurs: images called c and of class c, over images called c or of class c
    for c in set(truth) | set(predicted):
        both = sum(p == c and t == c for p, t in zip(predicted, truth, strict=True))
        either = sum(p == c or t == c for p, t in zip(predicted, truth, strict=True))
        ious.append(both / either)
    miou = sum(ious) / len(ious)
    padded = -(-n // ws) * ws  # DistributedSampler pads to a multiple of the world size by repeating from the start
    twice = right + right[:padded - n]
    assert 0 < sum(right) < n, "a model that gets every image right (or none) cannot tell the counts apart"
    assert f"counted {padded} images ({padded - n} counted twice), accuracy {sum(twice) / padded:.4f}" in out, out
    assert f"exact shards + reduce:     counted {n} images, accuracy {sum(right) / n:.4f}" in out, out
    assert f"single process:            counted {n} images, accuracy {sum(right) / n:.4f}" in out, out
    assert f"result: padded_count={padded} exact_count={n} exact_equals_single=True" in out  # + the loss sums
    assert (f"confusion matrix summed over the ranks: mean IoU {miou:.4f} (single process {miou:.4f}), "
            "matrices equal: True") in out, out
    # after reduce(dst=0): rank 0 holds the total of the shards; PyTorch promises nothing about the others
    held = {int(r): (int(own), float(value), seen) for r, own, value, seen in re.findall(
        r"^    rank (\d+): own shard (\d+), holds (\S+) = (the total|its own shard|neither) \(", out, re.M)}
    assert sorted(held) == list(range(ws)), out
    assert held[0] == (len(range(0, n, ws)), n, "the total"), held
    for r, (own, value, seen) in held.items():
        assert own == len(range(r, n, ws)), (r, held)
        assert seen == ("the total" if value == n else "its own shard" if value == own else "neither"), (r, held)


@pytest.mark.slow
def test_ddp_from_scratch_equals_ddp():
    out = make("ddp-from-scratch", "NPROC=2", timeout=120).stdout
    assert first_line(out).startswith("2 ranks, backend "), out  # the backend it chose, first
    held = re.findall(r"^  rank (\d): weights digest by hand (\w+), with DistributedDataParallel (\w+)$", out, re.M)
    assert [int(r) for r, _, _ in held] == [0, 1], out
    by_hand, with_ddp = {h for _, h, _ in held}, {d for _, _, d in held}
    assert len(by_hand) == 1 and len(with_ddp) == 1, held  # every rank holds the same weights, either way
    m = re.search(r"result: max_diff=(\S+) allclose=True", out)
    assert m and float(m.group(1)) < 1e-6
    if "device cpu" in out:  # the CPU's float arithmetic, reproduced here in one process to the last bit
        # what data parallelism must give: rank 0's initial weights, then 20 SGD steps on the average of the
        # gradients of each rank's own batches (rank r's data: a generator seeded 100 + r)
        torch.manual_seed(0)
        model = common.ToyModel()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        data = [torch.Generator().manual_seed(100 + r) for r in range(2)]
        for _ in range(20):
            grads = []
            for g in data:
                x, y = torch.randn(16, 10, generator=g), torch.randn(16, 5, generator=g)
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                grads.append([p.grad.clone() for p in model.parameters()])
            for p, g0, g1 in zip(model.parameters(), *grads, strict=True):
                p.grad = (g0 + g1) / 2
            optimizer.step()
        weights = torch.cat([p.detach().flatten() for p in model.parameters()])
        assert by_hand == with_ddp == {f"{zlib.crc32(weights.numpy().tobytes()):08x}"}, held
    assert "weights identical on all ranks: True" in out  # and the script's own check agrees


@pytest.mark.slow
@pytest.mark.waits
def test_hang_demo_fails_fast_and_names_the_problem():
    # timeouts are 10 s (mismatch) and 5 s (monitored barrier): the 90 s bound is far below 2 x 30 min
    res = make("hang-demo", "NPROC=2", timeout=90)
    assert res.output.count("failed in seconds, as it should") == 2
    assert "Detected mismatch between collectives on ranks" in res.output
    assert "OpType=ALLREDUCE" in res.output and "OpType=BARRIER" in res.output
    assert "Ranks 1 failed to pass monitoredBarrier in 5000 ms" in res.output  # half the group's 10 s
    # each run's first line, right after make's heading for it, names the backend the script chose
    for mode in ("mismatch", "straggler"):
        heading = re.search(rf"^--- \d/2 .*\n(?:NOTE: .*\n)?(mode {mode}, backend \w+, )", res.stdout, re.M)
        assert heading, res.stdout


@pytest.mark.slow
def test_backend_matrix_measures_the_gloo_cpu_marks(tmp_path):
    res = make("backend-matrix", "BACKEND=gloo", f"ARGS=--output-dir {tmp_path}", timeout=120)
    assert "backend gloo on cpu" in res.stdout  # Gloo means CPU tensors here, on any machine
    assert first_line(res.stdout).startswith("2 ranks, backend gloo, device cpu, "), res.stdout
    written = list(tmp_path.glob("backend_matrix_gloo_cpu_*.md"))
    assert len(written) == 1
    rows = {}
    for line in written[0].read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 5 and cells[1] in "✓✘":
            rows[cells[0]] = dict(zip(("float32", "float16", "int64"), cells[1:4], strict=True))
    assert len(rows) == 13
    list_all_to_all = gloo_has_list_all_to_all()  # measured here, apart from the script: 2.11's Gloo lacks it
    for op, marks in rows.items():
        for dtype, mark in marks.items():
            expected = "✘" if (op, dtype) in GLOO_CPU_FAILS or (op == "all_to_all" and not list_all_to_all) else "✓"
            assert mark == expected, (op, dtype, mark)


# what each case's broken run must end with, on one rank at least: the exception's type and a pattern of its message
# (None: it runs); written out here, not taken from error_cases.CASES
GLOO_TIMEOUT = "Timed out waiting|Application timeout caused pair closure"  # in the words of whichever rank
GALLERY = {
    "unused-parameters": ("RuntimeError", "Expected to have finished reduction in the prior iteration"),
    "uneven-inputs": ("RuntimeError", GLOO_TIMEOUT),
    "inplace-buffers": (None, ""),
    "different-models": ("RuntimeError", "appears not to match sizes of the same param in process 0"),
    "no-process-group": ("ValueError", "Default process group has not been initialized, please make sure to call "
                                       "init_process_group"),
    "after-destroy": ("ValueError", "Default process group has not been initialized"),
    "racing-checkpoint": ("RuntimeError", "torn checkpoint: .* loads, but its weights mix the ranks' writes"),
    "eval-through-wrapper": ("RuntimeError", GLOO_TIMEOUT),
}


SYNCED_BUFFERS = """
import inspect, torch, torch.nn as nn, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import common
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{common.free_port()}", rank=0, world_size=1)
net = nn.Sequential(nn.Linear(10, 10), nn.BatchNorm1d(10), nn.Linear(10, 1))
net[1].eval()
flag = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters else "broadcast_buffers"
model = DDP(net, **{flag: True})
try:
    (model(torch.randn(8, 10)).sum() + model(torch.randn(8, 10)).sum()).backward()
    print("runs")
except RuntimeError as err:
    print("raises" if "modified by an inplace operation" in str(err) else f"other: {err}")
dist.destroy_process_group()
"""


def raises_on_synced_buffers() -> bool:
    """What this torch does with two forwards before one backward when DDP copies the (frozen) BatchNorm buffers
    before each forward: one rank is enough to see it, apart from the gallery's own run."""
    found = in_fork(SYNCED_BUFFERS, timeout=60).stdout.split()
    assert found in (["runs"], ["raises"]), found
    return found == ["raises"]


@pytest.mark.slow
# four cases at a time, broken and fixed side by side: 16 light forked ranks that train nothing and mostly wait on
# 5 s timeouts, so the gallery shares the cores like a 2-rank run
def test_error_gallery_makes_each_error_and_its_fix_runs():
    res = make("errors", timeout=300, expect_rc=None)
    assert res.returncode == 0, res.stdout + res.stderr  # all of it: which case failed, and its ranks' output
    out = res.stdout
    # per case: its heading, the message it quoted from the broken run, how each rank of both runs ended
    cases = {name: (int(seconds), message, ranks) for name, seconds, message, ranks in re.findall(
        r"^--- (\S+): broken .*?\((\d+) s\), fixed .*\n    message: (.*)\n    ranks:   (.*)$", out, re.M)}
    assert list(cases) == list(GALLERY), out
    for name, (seconds, message, ranks) in cases.items():
        broken, fixed = (dict(re.findall(r"rank (\d) exit (-?\d+(?: [\w.]+)?)", part))
                         for part in ranks.split("; fixed "))  # rank -> its exit code and its exception's type
        assert fixed == {"0": "0", "1": "0"}, (name, ranks)  # the fix runs on both ranks
        kind, pattern = GALLERY[name]
        if kind is None:  # torch 2.14 no longer raises the in-place error of older versions: both ranks run
            if raises_on_synced_buffers():  # this torch still does (2.11): both ranks end on it
                assert broken == {"0": "1 RuntimeError", "1": "1 RuntimeError"}, (name, ranks)
                assert "modified by an inplace operation" in message, (name, message)
            else:
                assert broken == {"0": "0", "1": "0"}, (name, ranks)
            continue
        assert f"1 {kind}" in broken.values(), (name, ranks)  # a rank exited with 1 on this exception
        assert message.startswith(f"{kind}: ") and re.search(pattern, message), (name, message)
        if pattern == GLOO_TIMEOUT:  # it hung until the group's 5-second timeout
            assert seconds >= 5, (name, seconds)
    assert "Join: rank 0 ran 3 steps, rank 1 ran 2, and both finished" in out
    assert "fixed:   uneven evaluation batches (3 and 1) through the wrapper: fine; metrics 8" in out
    assert "fixed:   rank 0 wrote, every rank read the weights of rank 0: all 0" in out
    assert "result: 8 of 8 cases behave as described" in out  # and the gallery's own verdict agrees


@pytest.mark.slow
@pytest.mark.multigpu
def test_hang_demo_on_nccl_uses_a_gloo_side_group_for_the_monitored_barrier():
    # the make target echoes "failed in seconds" after any failure: the messages show which failure it was
    res = make("hang-demo", "NPROC=2", "BACKEND=nccl", timeout=180)
    assert res.output.count("failed in seconds, as it should") == 2, res.tail()
    # DETAIL wraps the NCCL group too: the mismatch is named before NCCL could hang on it
    assert "Detected mismatch between collectives on ranks" in res.output, res.tail()
    assert "OpType=ALLREDUCE" in res.output and "OpType=BARRIER" in res.output, res.tail()
    # monitored_barrier ran (on the Gloo side group: NCCL has none) and named the straggler
    assert "Ranks 1 failed to pass monitoredBarrier" in res.output, res.tail()


def test_the_old_names_of_all_gather_and_reduce_scatter_into_a_tensor_still_work_and_warn():
    code = """
import warnings, torch, torch.distributed as dist
import common
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{common.free_port()}", rank=0, world_size=1)
out = torch.zeros(3)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    dist.all_gather_into_tensor(out, torch.ones(3))
    dist.reduce_scatter_tensor(out, torch.full((3,), 2.0))
print(out.tolist(), [str(w.message)[:200] for w in caught])
dist.destroy_process_group()
"""
    res = in_fork(code, timeout=120)
    assert res.stdout.startswith("[2.0, 2.0, 2.0]"), res.tail()
    # they warn where the new names exist (torch 2.13 on); in 2.11 they are the only names, and silent
    new = hasattr(torch.distributed, "all_gather_single")
    assert ("all_gather_single" in res.stdout and "reduce_scatter_single" in res.stdout) == new, res.stdout


def test_the_scripts_are_plain_pytorch_without_the_course_machinery():
    """Section 05's scripts import torch, the standard library, common.py and each other: never tools/ nor
    workarounds.py, the course's own machinery."""
    for script in sorted((REPO / "05_collectives").glob("*.py")):
        tree = ast.parse(script.read_text())
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.module}
        assert not imported & {"tools", "workarounds"}, (script.name, sorted(imported))


def calls_in(tree, name: str) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == name]


def test_every_group_here_names_its_backend_and_waits_a_minute_at_most():
    """README: every group this section starts has a timeout, `--timeout` from 10 to 60 seconds by default (5 and
    30 seconds in error_cases.py), and names its backend."""
    defaults = []
    for script in sorted((REPO / "05_collectives").glob("*.py")):
        source = script.read_text()
        tree = ast.parse(source)
        for call in calls_in(tree, "init_process_group") + calls_in(tree, "new_group"):
            keywords = {k.arg for k in call.keywords}
            assert "timeout" in keywords, (script.name, ast.unparse(call))
            assert call.args or "backend" in keywords, (script.name, ast.unparse(call))
        if calls_in(tree, "init_process_group") and script.name != "error_cases.py":
            defaults.append(float(re.search(r'add_argument\("--timeout", type=float, default=([\d.]+)', source)[1]))
    assert (min(defaults), max(defaults)) == (10, 60), defaults
    constants = {node.targets[0].id: node.value.value for node in ast.parse(
        (REPO / "05_collectives/error_cases.py").read_text()).body if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Name) and isinstance(node.value, ast.Constant)}
    assert (constants["TIMEOUT"], constants["PATIENT"]) == (5, 30)


def test_the_scripts_end_with_a_barrier_and_none_skips_its_teardown_with_os_exit():
    """README, "Setting up and shutting down": the scripts end their normal path with a dist.barrier() before
    destroy_process_group (hang_demo.py fails on purpose before it gets there), and the os._exit guard is gone: only
    the gallery's driver calls it, in the workers it forks (a forked child must not run its parent's exit code)."""
    for script in sorted((REPO / "05_collectives").glob("*.py")):
        source = script.read_text()
        assert len(calls_in(ast.parse(source), "_exit")) == (script.name == "error_gallery.py"), script.name
        if "dist.destroy_process_group()" in source and script.name != "hang_demo.py":
            assert "dist.barrier()  # every rank finishes its work before any tears the group down" in source, script


def test_every_script_with_a_comm_hook_ends_gloo_with_monitored_barrier():
    """README (why a finished Gloo job can abort at exit): a comm hook written in Python gives Gloo tensors Python
    made; every script that registers one ends, on Gloo, with monitored_barrier(), not barrier()."""
    hooked = [path for path in REPO.glob("[0-9b]*/*.py") if "register_comm_hook(" in path.read_text()]
    assert {p.name for p in hooked} >= {"grad_accumulation.py", "ddp_timeline.py", "comm_hooks.py"}, hooked
    for path in hooked:
        source = path.read_text()
        assert "dist.monitored_barrier()" in source, path
        assert not re.search(r"^\s*dist\.barrier\(\)", source, re.M), f"{path}: a bare dist.barrier() line"


def test_distributed_eval_runs_on_the_cpu_with_gloo_on_any_machine():
    source = (REPO / "05_collectives/distributed_eval.py").read_text()
    inits = calls_in(ast.parse(source), "init_process_group")
    assert [ast.literal_eval(call.args[0]) for call in inits] == ["gloo"]
    assert not re.search(r"cuda|--device|--backend|device_and_backend", source)  # no way to another device


def test_backend_matrix_gives_each_op_a_fresh_group_and_agrees_on_the_default_one():
    """Its docstring: each op runs in a fresh process group, so that a failing op cannot disturb the next one's group;
    the ranks then agree on the mark over the default group."""
    tree = ast.parse((REPO / "05_collectives/backend_matrix.py").read_text())
    loop = next(node for node in ast.walk(tree) if isinstance(node, ast.For) and ast.unparse(node.iter) == "DTYPES")
    body = ast.unparse(loop)
    assert re.match(r"for dtype in DTYPES:\n    group = dist\.new_group\(", body), body  # first, for every op
    assert body.rstrip().endswith("dist.destroy_process_group(group)"), body  # and gone after it
    mark = [call for call in calls_in(loop, "all_reduce") if ast.unparse(call.args[0]) == "flag"]
    assert len(mark) == 1 and "group" not in {k.arg for k in mark[0].keywords}, body  # over the default group


def test_the_gallery_exits_1_when_a_case_misbehaves_and_runs_only_the_cases_asked_for(monkeypatch, capsys):
    """README: `make errors` exits with 1 if any case behaves otherwise than described; `--cases` runs some of the
    cases. The driver itself, with variants that end at once as told (no process starts)."""
    monkeypatch.syspath_prepend(str(REPO / "05_collectives"))
    import error_gallery

    said = ("[rank1] RuntimeError: [1]: params[0] in this process with sizes [12, 10] appears not to match sizes of "
            "the same param in process 0.")
    outcomes = {"broken": ([1, 1], said), "fixed": ([0, 0], "[rank0] every rank built the same model")}

    class Ended:
        def __init__(self, name, variant, port):
            self.codes, self.output = outcomes[variant]
            self.code, self.seconds = max(self.codes), 0.0

        def poll(self):
            return True

    monkeypatch.setattr(error_gallery, "Launch", Ended)
    # the driver imports torch._dynamo once for its forked workers (a second and more): none fork here
    monkeypatch.setitem(sys.modules, "torch._dynamo", sys.modules.get("torch._dynamo", types.ModuleType("_dynamo")))
    monkeypatch.setattr(sys, "argv", ["error_gallery.py", "--cases", "different-models"])
    assert error_gallery.main() == 0
    out = capsys.readouterr().out
    assert re.findall(r"^--- (\S+):", out, re.M) == ["different-models"], out
    assert "ranks:   broken rank 0 exit 1, rank 1 exit 1 RuntimeError; fixed rank 0 exit 0, rank 1 exit 0" in out
    assert "result: 1 of 1 cases behave as described" in out, out
    outcomes["broken"] = ([0, 0], "")  # the broken variant runs: not what the case describes
    assert error_gallery.main() == 1
    assert "result: 0 of 1 cases behave as described; NOT: different-models" in capsys.readouterr().out


@pytest.mark.slow
def test_one_case_of_the_error_gallery_runs_by_hand_with_torchrun():
    """error_cases.py's docstring: torchrun runs one variant of one case; the broken one ends with PyTorch's own
    message (that each fixed variant runs is the gallery's test, on the same function)."""
    cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--local-addr", "127.0.0.1", "--nproc-per-node",
           "2", REPO / "05_collectives/error_cases.py", "different-models"]
    broken = run([*cmd, "broken"], timeout=120, expect_rc=None)
    assert broken.returncode != 0, broken.tail()
    assert "appears not to match sizes of the same param in process 0" in broken.output, broken.tail()
    # started without torchrun, it says how to start it, in argparse's words
    alone = run([PYTHON, REPO / "05_collectives/error_cases.py", "different-models", "broken"], expect_rc=2)
    assert "error: start me with torchrun" in alone.stderr, alone.tail()
