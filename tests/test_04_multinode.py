"""Section 04: several nodes. "Nodes" here are groups of processes on this machine, or network namespaces."""

import os
import re
import shutil
import subprocess
import sys

import pytest

import common
from harness import BARE_ENV, PYTHON, REPO, TEST_IMAGES, check_trace, exits, in_fork, make, python, run, traced
from tools.standins import STANDIN_SIZES

SHORT = "--dataset mnist-standin --data-dir {} --epochs 1 --max-steps 5 --timeout 60"


def first_epoch_checkpoint(path) -> dict:
    """A checkpoint as the chain writes it after epoch 1 (model.module's weights, SGD with momentum, the epoch):
    the states a resumed run must start from."""
    import torch

    common.seed_everything(1)
    model = common.ConvNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    torch.nn.functional.cross_entropy(model(torch.randn(8, 1, 28, 28)), torch.arange(8)).backward()
    optimizer.step()  # momentum buffers: an optimizer state that a fresh SGD would not have
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 1}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return state


@pytest.mark.slow
@pytest.mark.ranks(4)
def test_two_nodes_by_hand_over_tcp(data_dir, tmp_path):
    """2 nodes x 2 processes continue a checkpoint of epoch 1 for epoch 2: every rank loads it, and global rank 0
    alone writes the new one (each node has a local rank 0: ranks 0 and 2)."""
    import torch

    from tools import tracecheck

    ck = tmp_path / "ck"
    first_epoch_checkpoint(ck / "mnist_tcp.pt")
    args = SHORT.format(data_dir).replace("--epochs 1", "--epochs 2") + f" --checkpoint-dir {ck}"
    res = make("multinode-tcp", "NNODES=2", "NPROC=2", "ARGS=" + args, env=traced(tmp_path / "trace"), timeout=240)
    check_trace(tmp_path / "trace", world_size=4, epochs=1,
                checks=("shards", "ddp", "buffers", "eval", "eval_sum", "writer"))
    for rank, local in ((0, 0), (1, 1), (2, 0), (3, 1)):
        assert f"rank {rank} (local rank {local}) of 4 joined via tcp://" in res.stdout
    assert "--node-rank 1 --local-rank 1" in res.stdout, "each process's command is printed"
    assert res.final["world_size"] == 4 and res.final["test_samples"] == TEST_IMAGES and res.final["epochs"] == 2
    assert f"resumed from {ck / 'mnist_tcp.pt'} after epoch 1" in res.stdout, res.tail()
    ranks = tracecheck.load(tmp_path / "trace")
    assert {r for r, events in ranks.items() if any(e["ev"] == "load" for e in events)} == {0, 1, 2, 3}
    assert tracecheck.check_resume(ranks).verdict == "ok", tracecheck.check_resume(ranks)  # SGD's momentum restored
    savers = {r for r, events in ranks.items() if any(e["ev"] == "save" for e in events)}
    assert savers == {0}, f"the checkpoint is written by global rank 0 alone, not by ranks {savers}"
    state = torch.load(ck / "mnist_tcp.pt", weights_only=True)
    assert state["epoch"] == 2
    common.ConvNet().load_state_dict(state["model"])  # model.module's keys: no "module." prefix


@pytest.mark.slow
@pytest.mark.multigpu
def test_two_simulated_nodes_get_a_gpu_each(data_dir):
    """Each simulated node sees only its own GPU (CUDA_VISIBLE_DEVICES), numbered 0 inside it: no duplicate GPU."""
    res = make("multinode-tcp", "NNODES=2", "NPROC=1", "ARGS=" + SHORT.format(data_dir), timeout=240)
    sys.path.insert(0, str(REPO / "04_multinode_tcp"))
    from gpus_per_node import visible_gpus  # the host's own ids: 0, 1, ... or those CUDA_VISIBLE_DEVICES names

    first, second = visible_gpus()[:2]
    assert f"CUDA_VISIBLE_DEVICES={first} " in res.stdout and f"CUDA_VISIBLE_DEVICES={second} " in res.stdout
    assert "this run: 1 process(es) per node on cuda with nccl" in res.stdout
    assert res.final["world_size"] == 2 and res.final["test_samples"] == TEST_IMAGES


def test_simulated_nodes_split_the_gpus_or_fall_back_to_the_cpu():
    sys.path.insert(0, str(REPO / "04_multinode_tcp"))
    from gpus_per_node import plan

    assert plan(2, 2, []) == (["", ""], "")  # no GPU: nothing to choose
    assert plan(2, 2, ["0", "1", "2", "3", "4", "5", "6", "7"]) == (["0,1", "2,3"], "")
    assert plan(2, 1, ["3", "5"]) == (["3", "5"], "")  # CUDA_VISIBLE_DEVICES=3,5 already set
    nodes, note = plan(2, 2, ["0", "1"])
    assert nodes == ["cpu", "cpu"] and "NOTE: THE NODES RUN ON THE CPU" in note and "need 4 GPUs" in note
    nodes, note = plan(2, 1, ["0"])
    assert nodes == ["cpu", "cpu"] and "1 are visible" in note


@pytest.mark.slow
def test_two_nodes_through_a_fresh_file(data_dir, bare):
    # bare: an interpreter without the course installed; the processes the launch script starts import common.py
    res = make("multinode-file", "NNODES=2", "NPROC=1", "ARGS=" + SHORT.format(data_dir), f"PY={bare}",
               env=BARE_ENV, timeout=240)
    assert "rank 1 (local rank 0) of 2 joined via file://" in res.stdout
    assert res.final["world_size"] == 2 and res.final["test_samples"] == TEST_IMAGES


@pytest.mark.slow
@pytest.mark.parametrize("rdzv, nproc", [pytest.param("static", 1, id="static")])
def test_two_torchrun_agents(rdzv, nproc, data_dir):
    """Two agents on this machine as two nodes, one worker each (the machine has 2 cores). With c10d every node
    runs the same command: the missing-node test runs the launcher's c10d command, and the uneven-nodes and Slurm
    tests train two c10d agents together."""
    res = make("multinode-torchrun", f"RDZV={rdzv}", "NNODES=2", f"NPROC={nproc}", "ARGS=" + SHORT.format(data_dir),
               timeout=240)
    assert res.stdout.count("-m torch.distributed.run --nnodes 2") == 2
    assert res.final["world_size"] == 2 * nproc and res.final["test_samples"] == TEST_IMAGES


@pytest.mark.slow
@pytest.mark.ranks(3)
def test_uneven_torchrun_nodes_of_2_and_1_processes(data_dir):
    """Two torchrun agents as two machines of 2 and 1 GPUs: c10d rendezvous, world size 2 + 1."""
    port = str(common.free_port())
    agents = "".join(
        f"{PYTHON} -m torch.distributed.run --nnodes 2 --nproc-per-node {n} --rdzv-backend c10d "
        f"--rdzv-endpoint 127.0.0.1:{port} --rdzv-id uneven-{port} --rdzv-conf join_timeout=60 --local-addr 127.0.0.1 "
        f"03_ddp_torchrun/mnist_torchrun.py {SHORT.format(data_dir)} --device cpu & p{n}=$!; " for n in (2, 1))
    out = run(["bash", "-c", agents + "wait $p2; a=$?; wait $p1; b=$?; echo exits $a $b"], timeout=240)
    assert "exits 0 0" in out.stdout, out.tail()
    assert re.search(r"^3 processes, [12] on this node, on cpu with gloo$", out.stdout, re.M), out.tail()
    assert out.final["world_size"] == 3 and out.final["test_samples"] == TEST_IMAGES


@pytest.mark.slow
@pytest.mark.parametrize("rdzv", ["static", "c10d"])
@pytest.mark.waits
def test_a_missing_node_fails_in_seconds_not_minutes(rdzv, data_dir):
    # torchrun's own join timeout is 600 s: the 90 s bound fails a launcher that passes none; the printed
    # command shows JOIN_TIMEOUT=5 reaching torchrun (the launcher's own default is 30)
    res = run(["bash", REPO / "04_multinode_tcp/launch_torchrun_nodes.sh", rdzv, "2", "1",
               *SHORT.format(data_dir).split()],
              env={"PYTHON": PYTHON, "JOIN_TIMEOUT": "5", "ONLY_NODES": "0"}, timeout=90, expect_rc=1)
    assert "a node failed" in res.stderr
    conf = "timeout=5" if rdzv == "static" else "join_timeout=5"
    assert re.search(rf"^node 0: .* --rdzv-conf {conf} ", res.stdout, re.M), res.tail()
    if rdzv == "static":  # the master's store says how long it waited: 5 s (and a second of polling), not 30
        assert re.search(r"Timed out after ([5-9]|1\d) seconds waiting for clients\. 1/2 clients joined", res.stderr), \
            res.tail()
    else:  # c10d names no time: the agent gave up on the rendezvous
        assert "RendezvousTimeoutError" in res.stderr, res.tail()


@pytest.mark.slow
@pytest.mark.waits
def test_a_missing_rank_fails_every_started_process_with_a_clear_message(data_dir):
    """World size 3, only ranks 0 and 1 started: both fail within the 5 s timeout, in PyTorch's own words."""
    port = str(common.free_port())
    out = run(["bash", "-c", "".join(  # both in the background; `wait PID` gives each one's exit status
        f"{PYTHON} 04_multinode_tcp/mnist_tcp.py --init-method tcp://127.0.0.1:{port} --world-size 3 "
        f"--rank {r} --timeout 5 {SHORT.format(data_dir).replace('--timeout 60', '')} & p{r}=$!; " for r in (0, 1))
        + "wait $p0; a=$?; wait $p1; b=$?; echo exits $a $b"], timeout=60)
    assert "exits 1 1" in out.stdout, out.tail()
    assert re.search(r"Timed out after ([5-9]|1\d) seconds waiting for clients. 2/3 clients joined", out.stderr), \
        out.tail()


def test_port_taken_and_bad_file_paths_get_clear_errors(tmp_path):
    import socket
    import time

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        res = python("04_multinode_tcp/mnist_tcp.py", "--init-method", f"tcp://127.0.0.1:{port}", "--world-size",
                     "1", "--rank", "0", "--timeout", "5", "--dataset", "mnist-standin", expect_rc=1, timeout=60)
    assert "EADDRINUSE" in res.stderr  # PyTorch's own words, by hand; the file:// checks are the preflight's
    old = tmp_path / "old-init"
    old.write_text("")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    missing, left = exits([("tools/preflight.py", ["04_multinode_tcp/mnist_tcp.py", "--init-method", init,
                                                   "--world-size", "1", "--rank", "0"])
                           for init in (f"file://{tmp_path}/no/such/dir/init", f"file://{old}")])
    assert missing[0] == 2 and "does not exist or is not writable" in missing[2], missing
    assert left[0] == 2 and "already exists, left by an earlier job" in left[2], left


def test_a_file_init_path_is_refused_only_once_it_is_older_than_a_minute(tmp_path):
    """make's preflight refuses a file:// path left by an earlier job: one that exists and is older than 60 s."""
    import time

    from tools import course

    init = tmp_path / "init"
    course._check_init_method(f"file://{init}")  # new: fine
    init.write_text("")
    for age, refused in ((30, False), (90, True)):
        os.utime(init, (time.time() - age, time.time() - age))
        if refused:
            with pytest.raises(course.UsageError, match="left by an earlier job"):
                course._check_init_method(f"file://{init}")
        else:
            course._check_init_method(f"file://{init}")  # another rank of this job made it a moment ago


def test_the_launch_scripts_take_a_free_port_and_wait_30_s_for_a_missing_node():
    """README: the launch scripts pick a free port (the OS chooses: a bind to port 0); launch_torchrun_nodes.sh
    passes a 30 s rendezvous limit unless JOIN_TIMEOUT is given (the missing-node test gives 5)."""
    free = "s.bind((\"127.0.0.1\", 0))"
    for script in ("launch_local.sh", "launch_torchrun_nodes.sh"):
        source = (REPO / "04_multinode_tcp" / script).read_text()
        assert free in source and "port=$(" in source, script
    nodes = (REPO / "04_multinode_tcp/launch_torchrun_nodes.sh").read_text()
    assert "join_timeout=${JOIN_TIMEOUT:-30}" in nodes
    assert "timeout=$join_timeout" in nodes and "join_timeout=$join_timeout" in nodes, "static and c10d"


def test_mnist_tcp_refuses_impossible_ranks():
    base = ["04_multinode_tcp/mnist_tcp.py", "--init-method", "tcp://127.0.0.1:1"]
    cases = [
        (["--world-size", "2", "--rank", "2"], "rank 2, local rank 0, world size 2: ranks run from 0"),
        (["--world-size", "4", "--nproc-per-node", "2", "--node-rank", "1", "--local-rank", "2"],
         "--local-rank 2: local ranks run from 0 to --nproc-per-node - 1"),
        (["--world-size", "4", "--nproc-per-node", "2", "--node-rank", "2", "--local-rank", "0"],
         "rank 4, local rank 0, world size 4: ranks run from 0"),
        (["--world-size", "4", "--node-rank", "1", "--local-rank", "0"], "--node-rank with --nproc-per-node"),
        (["--world-size", "2"], "give --rank, or --node-rank with --nproc-per-node and --local-rank"),
        (["--world_size", "2", "-r", "0", "--use_mix_precision"],  # the source notes' command line
         "the source notes' --use_mix_precision -> 06_amp_syncbn/mnist_amp_syncbn.py --use_mix_precision"),
    ]
    cases.append((["--init-method", "env://", "--world-size", "1", "--rank", "0"], "--init-method must be tcp://"))
    answers = exits([("tools/preflight.py", base + extra) for extra, _ in cases])  # the last --init-method wins
    for (extra, message), (code, _, err) in zip(cases, answers, strict=True):
        assert code == 2 and message in err and "Traceback" not in err, (extra, err)


def _can_make_netns() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if not shutil.which("ip"):
        return "needs the ip command (iproute2)"
    probe = subprocess.run(["ip", "netns", "add", f"ddp-probe-{os.getpid()}"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"ip netns add is not permitted here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", f"ddp-probe-{os.getpid()}"], check=True)
    return None


NETNS_SKIP = _can_make_netns()


def _our_namespaces(tag: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.startswith(("ddp0-", "ddp1-")) and tag in line]


@pytest.mark.slow
@pytest.mark.skipif(NETNS_SKIP is not None, reason=str(NETNS_SKIP))
def test_two_real_hosts_in_network_namespaces(data_dir, tmp_path):
    res = make("multinode-netns", "NPROC=1", "ARGS=" + SHORT.format(data_dir), env=traced(tmp_path / "trace"),
               timeout=240)
    hosts = re.findall(r"host (\d): namespace (ddp\d-\d+), interface (\S+), address (\S+)", res.stdout)
    assert len(hosts) == 2 and hosts[0][3] != hosts[1][3]
    assert f"--init-method tcp://{hosts[0][3]}:29500" in res.stdout
    from tools import tracecheck

    ranks = tracecheck.load(tmp_path / "trace")
    assert sorted(ranks) == [0, 1]
    for rank, events in ranks.items():  # what each rank saw: rank r is on host r
        env = next(e for e in events if e["ev"] == "init")["env"]
        assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == hosts[rank][2], env
        # NCCL over sockets on the veth: on a machine with InfiniBand/RoCE cards its IB transport would skip it
        assert env["NCCL_IB_DISABLE"] == "1" and env["NCCL_NET"] == "Socket", env
    assert res.final["world_size"] == 2 and res.final["test_samples"] == TEST_IMAGES
    tag = hosts[0][1].split("-")[1]
    assert not _our_namespaces(tag), "the namespaces must be removed afterwards"


@pytest.mark.slow
@pytest.mark.skipif(NETNS_SKIP is not None, reason=str(NETNS_SKIP))
def test_without_gloo_socket_ifname_the_two_hosts_cannot_connect(data_dir):
    res = run(["bash", REPO / "04_multinode_tcp/netns_2hosts.sh", "1", "--device", "cpu",  # the lesson: Gloo
               *SHORT.format(data_dir).replace("--timeout 60", "--timeout 15").split()],
              env={"PYTHON": PYTHON, "BREAK": "1"}, timeout=120, expect_rc=1)
    tag = re.search(r"namespace ddp0-(\d+)", res.stdout).group(1)
    assert not _our_namespaces(tag), "the namespaces must be removed on failure too"


def test_netns_demo_explains_itself_without_root():
    """Run as an unprivileged user: this one, or (as root) nobody."""
    as_user = ["runuser", "-u", "nobody", "--"] if os.geteuid() == 0 else []
    if as_user and not shutil.which("runuser"):
        pytest.skip("root, and no runuser to become an unprivileged user")
    res = run([*as_user, "bash", REPO / "04_multinode_tcp/netns_2hosts.sh"], expect_rc=77)
    assert "needs root" in res.stderr and "Nothing was changed" in res.stderr


def port_is_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@pytest.mark.slow
def test_slurm_script_builds_the_torchrun_command_and_runs(tmp_path, bare):
    """The job script as a first job on a fresh node: no preflight, so local rank 0 prepares the data while the
    other rank waits at a barrier, and it is generated once."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text("#!/bin/sh\necho localhost\necho othernode\n")
    (fake / "srun").write_text('#!/bin/sh\nexec "$@"\n')  # one node: run the command right here
    # this machine plays a cluster node, but its host name may not resolve as a node's does: bind the agent to
    # 127.0.0.1 (the script's own command line is checked below)
    # bare: a cluster's Python, without the course installed; the job script puts the course's folder on PYTHONPATH
    (fake / "torchrun").write_text(f'#!/bin/sh\nexec "{bare}" -m torch.distributed.run --local-addr 127.0.0.1 "$@"\n')
    for f in fake.iterdir():
        f.chmod(0o755)
    job = next(j for j in range(4242, 20000) if port_is_free(20000 + j))  # the script's port: 20000 + job id
    env = {"PATH": f"{fake}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "localhost,othernode",
           "SLURM_JOB_ID": str(job), "SLURM_NNODES": "1", "SLURM_GPUS_ON_NODE": "2",
           "TORCHRUN": str(fake / "torchrun"), **BARE_ENV}
    res = run(["bash", REPO / "04_multinode_tcp/slurm_ddp.sbatch", *SHORT.format(tmp_path / "fresh").split()],
              env=env, timeout=180)
    assert re.search(rf"on every node: \S*torchrun --nnodes 1 --nproc-per-node 2 --rdzv-backend c10d "
                     rf"--rdzv-endpoint localhost:{20000 + job} --rdzv-id {job} --rdzv-conf join_timeout=300 "
                     rf"03_ddp_torchrun/mnist_torchrun.py", res.stdout), res.stdout
    assert res.final["world_size"] == 2
    assert len(re.findall(r"^generated the mnist-standin in ", res.output, re.M)) == 1, res.tail()
    assert res.final["test_samples"] == STANDIN_SIZES["mnist"][1]  # made whole, as a user's first run makes it


@pytest.mark.slow
@pytest.mark.ranks(3)
def test_one_command_per_machine_with_machines_of_2_and_1_processes():
    out = make("multinode-spawn", "PROCS=2,1", timeout=180).stdout
    # one command per "machine", each spawning its own processes, with the notes' rank arithmetic
    assert len(re.findall(r"^machine \d: \S*spawn_per_node\.py --nproc-per-node 2,1 --node-rank \d", out, re.M)) == 2
    found = {int(r): (int(before), int(local), int(machine)) for r, before, local, machine in re.findall(
        r"^rank (\d+) = (\d+) \(processes on the machines before\) \+ local rank (\d+), on machine (\d+)", out, re.M)}
    assert found == {0: (0, 0, 0), 1: (0, 1, 0), 2: (2, 0, 1)}, out
    result = re.search(r"^result: world_size=(\d+) machines=(\d+) w=([-\d.]+) b=([-\d.]+) ranks_agree=(\w+)$",
                       out, re.M)
    assert result and result[1] == "3" and result[2] == "2" and result[5] == "True", out
    assert abs(float(result[3]) - 2) < 0.1 and abs(float(result[4]) - 1) < 0.1  # DDP learned y = 2x + 1


@pytest.mark.slow
@pytest.mark.waits
def test_the_cheat_sheets_world_size_16_says_its_plan_and_names_nproc_per_node_when_the_others_never_come():
    """`demo.py --world_size=16 --node_rank=0 --master_addr --master_port` meant two machines of 8; spawn_per_node
    plans 8 of 2 (its default of 2 per machine), says so at once, and when the others never come says what to give."""
    port = common.free_port()
    res = run([PYTHON, REPO / "04_multinode_tcp/spawn_per_node.py", "--world_size=4", "--node_rank=0",
               "--master_addr=127.0.0.1", f"--master_port={port}", "--timeout", "5", "--device", "cpu"],
              expect_rc=1, timeout=90)
    assert "plan: 2 machine(s) of 2+2 process(es) = 4; this is machine 0, ranks 0..1" in res.stdout
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("spawn_per_node: error: ") and "--nproc-per-node" in last, res.tail()
    assert "processes joined within --timeout 5 s" in last


def test_a_rank_at_or_above_the_world_size_is_refused_by_gloo_when_the_group_is_made():
    """PyTorch's Python layer takes rank 1 of a world of 1; Gloo refuses it when it builds the group, once the
    process has reached the store (here a store of its own, so there is nothing else to wait for)."""
    code = """
import datetime, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
try:
    dist.init_process_group("gloo", store=store, rank=1, world_size=1, timeout=datetime.timedelta(seconds=5))
except RuntimeError as err:
    print(str(err).splitlines()[0])
"""
    res = in_fork(code, timeout=60)
    assert "gloo/context.cc" in res.stdout and "rank < size. 1 vs 1" in res.stdout, res.tail()
