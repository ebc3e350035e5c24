"""The DDP basics on a toy model: each demo named on the command line gets processes of its own from mp.spawn.

    python 02_ddp_spawn/ddp_basics.py basic            # DDP(ToyModel): one step, gradients averaged
    python 02_ddp_spawn/ddp_basics.py checkpoint       # rank 0 saves, barrier, every rank loads
    python 02_ddp_spawn/ddp_basics.py model-parallel   # each process holds a model split over 2 devices
    python 02_ddp_spawn/ddp_basics.py process          # the same as basic, with bare mp.Process start/join
    python 02_ddp_spawn/ddp_basics.py fail             # rank 1 raises: mp.spawn stops everyone
    python 02_ddp_spawn/ddp_basics.py basic checkpoint # several, one after the other, each with its own processes
    make ddp-basics                                    # the first four, one after the other
"""

import argparse
import gc
import os
import sys
import tempfile
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import common


class ToyMpModel(nn.Module):
    """ToyModel split over two devices (model parallelism): net1 on dev0, net2 on dev1."""

    def __init__(self, dev0, dev1):
        super().__init__()
        self.dev0, self.dev1 = torch.device(dev0), torch.device(dev1)
        self.net1 = nn.Linear(10, 10).to(self.dev0)
        self.net2 = nn.Linear(10, 5).to(self.dev1)

    def forward(self, x):
        x = torch.relu(self.net1(x.to(self.dev0)))
        return self.net2(x.to(self.dev1))


def run_demo(rank, world_size, args):
    """The life of one process: join the group, run the demo, leave the group. mp.spawn calls this."""
    if args.demo == "fail" and rank == 1:  # e.g. a missing file: rank 1 dies while rank 0 waits for it
        raise RuntimeError("rank 1 fails on purpose before joining the process group")
    if args.demo == "model-parallel":  # two GPUs per process: this one's first is 2 * rank (main checked them)
        device = torch.device("cuda", 2 * rank) if args.device == "cuda" else torch.device("cpu")
        backend = args.backend
    else:
        device, backend = common.device_and_backend(args.device, args.backend, rank, world_size)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this process's GPU, before anything touches CUDA
    # env://, as the notes' setup() does: MASTER_ADDR and MASTER_PORT come from the parent's environment. A model
    # that spans two GPUs binds no device: NCCL would refuse the half that lives on the other one
    bind = backend == "nccl" and args.demo != "model-parallel"
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=args.timeout), device_id=device if bind else None)
    try:
        DEMOS[args.demo](rank, world_size, device, args)
        dist.barrier()  # every rank finishes its work before any tears the group down
    finally:
        gc.collect()  # a workaround, not DDP: free the DDP model (it lives in reference cycles) before its group
        dist.destroy_process_group()


def one_step(model, device, out_device=None):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    optimizer.zero_grad()
    outputs = model(torch.randn(20, 10, device=device))
    labels = torch.randn(20, 5, device=out_device or device)
    nn.MSELoss()(outputs, labels).backward()  # DDP averages the gradients of all ranks here
    optimizer.step()


def digest(model) -> str:
    """A short fingerprint of the weights (a CRC-32 of every parameter's bytes): equal digests, equal weights."""
    flat = torch.cat([p.detach().flatten().cpu() for p in model.parameters()])
    return f"{zlib.crc32(flat.numpy().tobytes()):08x}"


def same_on_all_ranks(model, device) -> bool:
    """True when every rank holds exactly rank 0's parameters (compared on `device`, the one the group uses)."""
    flat = torch.cat([p.detach().flatten().to(device) for p in model.parameters()])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    verdict = torch.tensor([float(torch.equal(flat, reference))], device=flat.device)
    dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
    return bool(verdict.item())


def demo_basic(rank, world_size, device, args):
    # every rank prints: the newline inside the string and end="" make one write, so lines never mix
    print(f"rank {rank}/{world_size}: running the basic DDP example on {device}\n", end="", flush=True)
    net = common.ToyModel().to(device)  # every process draws its own random weights...
    at_init = digest(net)
    model = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)  # ...DDP copies rank 0's to all
    wrapped = digest(model)
    one_step(model, device)  # every rank feeds different random data...
    # ...and still ends with the same weights: the last digest is the same on every rank
    print(f"rank {rank}: weights digest {at_init} at init, {wrapped} after DDP(), {digest(model)} after one step\n",
          end="", flush=True)
    same = same_on_all_ranks(model, device)
    if rank == 0:
        print(f"after one step on different data, all {world_size} ranks hold the same weights: {same}", flush=True)


def demo_checkpoint(rank, world_size, device, args):
    model = DDP(common.ToyModel().to(device), device_ids=[device.index] if device.type == "cuda" else None)
    path = os.path.join(args.workdir, "toy.pt")
    if rank == 0:  # the weights are the same everywhere, so one process saves them
        torch.save(model.module.state_dict(), path + ".tmp")
        os.replace(path + ".tmp", path)  # a crash while saving leaves no half-written file under the real name
        print(f"rank 0 saved {path}", flush=True)
    dist.barrier()  # nobody reads before rank 0 has finished writing
    # the file says "cuda:0" (where rank 0 saved it); map it to this rank's device
    map_location = {"cuda:0": str(device)} if device.type == "cuda" else "cpu"
    model.module.load_state_dict(torch.load(path, map_location=map_location, weights_only=True))
    print(f"rank {rank} loaded the checkpoint (weights_only=True, map_location={map_location})\n", end="", flush=True)
    loaded = digest(model)
    one_step(model, device)
    print(f"rank {rank}: weights digest {loaded} as loaded, {digest(model)} after one step\n", end="", flush=True)
    same = same_on_all_ranks(model, device)
    dist.barrier()  # every rank has read the file before it is removed
    if rank == 0:
        os.remove(path)
        print(f"after loading and one more step, all ranks hold the same weights: {same}", flush=True)


def demo_model_parallel(rank, world_size, device, args):
    dev0, dev1 = (device, torch.device("cuda", device.index + 1)) if device.type == "cuda" else (device, device)
    if device.type == "cpu" and rank == 0:
        print(f"model parallel wants 2 GPUs per process ({2 * world_size} in all): here both halves run on the CPU; "
              f"the code path is the same", flush=True)
    model = DDP(ToyMpModel(dev0, dev1))  # no device_ids for a model that spans several devices
    wrapped = digest(model)
    one_step(model, dev0, out_device=dev1)  # outputs come out on dev1
    print(f"rank {rank}: weights digest {wrapped} after DDP(), {digest(model)} after one step\n", end="", flush=True)
    same = same_on_all_ranks(model, dev0)
    print(f"rank {rank}: net1 on {dev0}, net2 on {dev1}\n", end="", flush=True)
    if rank == 0:
        print(f"model parallel inside, data parallel across: ranks agree: {same}", flush=True)


# fail: rank 1 raises before it joins (run_demo), so rank 0 waits in init_process_group until mp.spawn stops it
DEMOS = {"basic": demo_basic, "checkpoint": demo_checkpoint, "model-parallel": demo_model_parallel,
         "fail": demo_basic}


def model_parallel_placement(device: str, backend: str, nproc: int) -> tuple[str, str]:
    """2 GPUs per process: CUDA + NCCL with 2 x nproc GPUs, else both halves on the CPU with Gloo (same code)."""
    gpus = common.usable_gpus()
    if gpus >= 2 * nproc and device != "cpu":
        return "cuda", "gloo" if backend == "gloo" else "nccl"
    if device == "cuda" or backend == "nccl":
        fewer = f"use --nproc {gpus // 2}, or " if gpus >= 4 else ""
        raise RuntimeError(f"model parallel needs 2 GPUs per process: {2 * nproc} for --nproc {nproc}, "
                           f"{gpus} here; {fewer}drop --device/--backend to run both halves on the CPU")
    return "cpu", "gloo"  # the demo says so on rank 0


def start_with_process(fn, world_size, args):
    """What mp.spawn does for you, by hand: start one Process per rank, then wait for each."""
    ctx = mp.get_context("spawn")  # a fresh interpreter per process, as mp.spawn uses
    processes = [ctx.Process(target=fn, args=(rank, world_size, args)) for rank in range(world_size)]
    for p in processes:
        p.start()
    for p in processes:
        p.join()
    failed = [rank for rank, p in enumerate(processes) if p.exitcode != 0]
    if failed:
        sys.exit(f"ranks {failed} failed")
    print(f"mp.Process: {world_size} processes started and joined, all exit codes 0", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("demos", nargs="+", choices=[*DEMOS, "process"], metavar="DEMO",
                        help=f"one or more of: {', '.join([*DEMOS, 'process'])}")
    parser.add_argument("--nproc", type=int, default=2, help="processes to start (default %(default)s)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    parser.add_argument("--timeout", type=float, default=30.0, help="process group timeout, seconds")
    args = parser.parse_args()
    if args.nproc < 2:
        parser.error("--nproc must be at least 2: these demos compare ranks")
    runs = [argparse.Namespace(**vars(args), demo=demo) for demo in args.demos]
    for run in runs:
        if run.demo == "model-parallel":  # 2 GPUs per process: said in one line before any demo starts
            try:
                run.device, run.backend = model_parallel_placement(args.device, args.backend, args.nproc)
            except RuntimeError as err:
                parser.error(str(err))
    for run in runs:
        if len(runs) > 1:
            print(f"--- ddp_basics.py {run.demo}", flush=True)
        start(run)


def start(args):
    """One demo: its own processes, its own process group, on a port that is free now."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"  # the workers all run on this machine
    os.environ["MASTER_PORT"] = str(common.free_port())  # a free port now; a fixed one may be taken
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does: N processes x all cores would fight
    with tempfile.TemporaryDirectory() as workdir:
        args.workdir = workdir  # shared by all ranks on this machine (the checkpoint demo)
        if args.demo == "process":
            args.demo = "basic"
            start_with_process(run_demo, args.nproc, args)
            return
        try:
            # mp.spawn(fn, args, nprocs) calls fn(rank, *args) in nprocs fresh processes and waits
            mp.spawn(run_demo, args=(args.nproc, args), nprocs=args.nproc, join=True)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
            sys.exit(f"ddp_basics {args.demo}: a worker failed, mp.spawn stopped the others.\n{err}")


if __name__ == "__main__":
    main()
