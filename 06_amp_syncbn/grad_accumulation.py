"""Gradient accumulation under DDP, done right: no all-reduce on the micro-batches before the last.

Every backward() of a DDP model all-reduces the gradients. When several micro-batches make up one
optimizer step, only the last one needs to: wrap the others in `with model.no_sync():`. A comm
hook counts the all-reduces, and both variants are compared with one process on the whole batch.

    torchrun --standalone --nproc-per-node 2 06_amp_syncbn/grad_accumulation.py --accum-steps 4
    make grad-accum NPROC=2

It runs on the CPU with Gloo on every machine, GPUs or not: the lesson is arithmetic, not devices.
"""

import argparse
import contextlib
import gc
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import common


def counting_allreduce(state, bucket):
    """DDP's own all-reduce hook, plus a counter."""
    state["calls"] += 1
    return default_hooks.allreduce_hook(None, bucket)


def accumulated_grads(rank, x, y, accum, use_no_sync):
    torch.manual_seed(0)
    model = DDP(common.ToyModel())
    calls = {"calls": 0}
    model.register_comm_hook(calls, counting_allreduce)
    for i, (xb, yb) in enumerate(zip(x.chunk(accum), y.chunk(accum), strict=True)):
        last = i == accum - 1
        sync = contextlib.nullcontext() if last or not use_no_sync else model.no_sync()
        with sync:  # inside no_sync, backward only accumulates into .grad
            (nn.functional.mse_loss(model(xb), yb) / accum).backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return grads, calls["calls"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accum-steps", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--micro-batch", type=int, default=8, help="samples per micro-batch")
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args()
    if args.accum_steps < 1 or args.micro_batch < 1:
        parser.error("--accum-steps and --micro-batch must be at least 1")
    # the CPU and Gloo on every machine: the lesson is arithmetic; RANK and WORLD_SIZE come from torchrun
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    try:
        rank, ws = dist.get_rank(), dist.get_world_size()
        per_rank = args.accum_steps * args.micro_batch
        g = torch.Generator().manual_seed(1)
        x_all, y_all = torch.randn(ws * per_rank, 10, generator=g), torch.randn(ws * per_rank, 5, generator=g)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)

        with_no_sync, calls_no_sync = accumulated_grads(rank, x_all[mine], y_all[mine], args.accum_steps, True)
        every_step, calls_every = accumulated_grads(rank, x_all[mine], y_all[mine], args.accum_steps, False)

        torch.manual_seed(0)
        reference = common.ToyModel()  # one process, the whole global batch, one backward
        nn.functional.mse_loss(reference(x_all), y_all).backward()
        big = torch.cat([p.grad.flatten() for p in reference.parameters()])

        d1, d2 = (with_no_sync - big).abs().max().item(), (every_step - big).abs().max().item()
        if rank == 0:
            print(f"{ws} ranks x {args.accum_steps} micro-batches of {args.micro_batch} "
                  f"vs one batch of {ws * per_rank}:\n"
                  f"  with no_sync:    {calls_no_sync} all-reduce(s), max |grad difference| {d1:.2e}, "
                  f"gradient norm {with_no_sync.norm():.7f}\n"
                  f"  without no_sync: {calls_every} all-reduce(s), max |grad difference| {d2:.2e}, "
                  f"gradient norm {every_step.norm():.7f}\n"
                  f"result: calls_no_sync={calls_no_sync} calls_every_step={calls_every} "
                  f"equal={d1 < 1e-6 and d2 < 1e-6}", flush=True)
        # every rank finishes its work before any tears the group down. Not dist.barrier(): on Gloo it holds on to
        # the all-reduces still in flight, and a Gloo thread frees them after it returns; this script's hook gave
        # them tensors that Python made, and freeing those while Python shuts down aborts the rank (05's README)
        dist.monitored_barrier()
    finally:
        gc.collect()  # a workaround, not DDP: free the DDP model (it lives in reference cycles) before its group
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
