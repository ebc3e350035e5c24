"""The errors everyone meets with DDP, each made on purpose: one function per case, broken and fixed side by side.

Every case runs on 2 processes, on the CPU with Gloo. Run one variant of one case and read its error:

    torchrun --standalone --nproc-per-node 2 05_collectives/error_cases.py uneven-inputs broken
    torchrun --standalone --nproc-per-node 2 05_collectives/error_cases.py uneven-inputs fixed

CASES names each case with the message its broken variant ends with. error_gallery.py (`make errors`) runs every
case both ways, checks those messages and that each fix runs, and prints the table of causes and fixes.
"""

import argparse
import gc
import inspect
import io
import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

TIMEOUT = 5.0  # seconds a collective may wait in a broken variant that hangs until the timeout
PATIENT = 30.0  # everywhere else: a rank that starts late on busy cores must not turn into a timeout


class TwoHeads(nn.Module):
    """A model whose second head is used only when asked: its parameters get no gradient otherwise."""

    def __init__(self):
        super().__init__()
        self.body, self.head, self.spare = nn.Linear(10, 10), nn.Linear(10, 5), nn.Linear(10, 5)

    def forward(self, x, use_spare=False):
        h = torch.relu(self.body(x))
        return self.spare(h) if use_spare else self.head(h)


def unused_parameters(rank, variant):
    """A parameter that gets no gradient: DDP waits for it, and the next iteration finds the last one unfinished."""
    def ms_per_step(model, steps):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        start = time.perf_counter()
        for _ in range(steps):
            optimizer.zero_grad()
            model(torch.randn(8, 10)).sum().backward()
            optimizer.step()
        return (time.perf_counter() - start) / steps * 1000

    torch.manual_seed(0)
    if variant == "broken":
        ms_per_step(DDP(TwoHeads()), 3)
        return
    costs = {"find_unused_parameters=True": ms_per_step(DDP(TwoHeads(), find_unused_parameters=True), 20),
             "static_graph=True": ms_per_step(DDP(TwoHeads(), static_graph=True), 20),
             "the model without the unused head": ms_per_step(DDP(nn.Sequential(nn.Linear(10, 10), nn.ReLU(),
                                                                                 nn.Linear(10, 5))), 20)}
    if rank == 0:
        print("fixed three ways, ms per step: " + "; ".join(f"{k} {v:.2f}" for k, v in costs.items()))


def uneven_inputs(rank, variant):
    """Rank 0 has one batch more than rank 1: its last backward all-reduces with nobody."""
    from torch.distributed.algorithms.join import Join

    model = DDP(nn.Linear(10, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [torch.randn(4, 10) for _ in range(3 if rank == 0 else 2)]

    def loop():
        for x in batches:
            optimizer.zero_grad()
            model(x).sum().backward()
            optimizer.step()

    if variant == "broken":
        loop()
        return
    with Join([model]):  # ranks that run out of data shadow the others' all-reduces with zeros
        loop()
    if rank == 0:
        print("Join: rank 0 ran 3 steps, rank 1 ran 2, and both finished")


def inplace_buffers(rank, variant):
    """Two forwards before one backward, with BatchNorm in eval mode (frozen statistics, as in fine-tuning):
    DDP copies rank 0's buffers into the running statistics before each forward, in place, and the first
    forward's autograd graph had saved them. torch 2.11 fails here; torch 2.14.1 makes that copy without
    bumping the buffers' version counters, so both variants run."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(10, 10), nn.BatchNorm1d(10), nn.Linear(10, 1))
    net[1].eval()  # frozen BatchNorm: the forward uses running_mean and running_var
    # torch 2.14 calls the flag forward_sync_buffers; torch 2.11 calls it broadcast_buffers
    flag = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters
            else "broadcast_buffers")
    model = DDP(net, **{flag: variant == "broken"})
    a, b = torch.randn(8, 10), torch.randn(8, 10)
    (model(a).sum() + model(b).sum()).backward()
    if rank == 0:
        print(f"{flag}={variant == 'broken'}: two forwards, one backward, no error")


def different_models(rank, variant):
    """Every rank must build the same model; DDP compares them when it wraps."""
    width = 10 if variant == "fixed" or rank == 0 else 12
    DDP(nn.Sequential(nn.Linear(10, width), nn.ReLU(), nn.Linear(width, 5)))
    if rank == 0:
        print("every rank built the same model")


def no_process_group(rank, variant):
    """A collective before init_process_group (run_case starts this case without a group)."""
    if variant == "fixed":
        dist.init_process_group("gloo", timeout=timedelta(seconds=PATIENT))
    dist.all_reduce(torch.ones(1))
    if rank == 0:
        print("all_reduce after init_process_group: fine")


def after_destroy(rank, variant):
    """A collective after destroy_process_group, such as a last metric all-reduced in a `finally`."""
    x = torch.ones(1)
    if variant == "broken":
        dist.barrier()  # every rank connected first: a group destroyed at once can fail a slower rank's init
        dist.destroy_process_group()
    dist.all_reduce(x)
    if rank == 0:
        print(f"the all_reduce came before destroy_process_group: {x.item():g}")


def racing_checkpoint(rank, variant):
    """Every rank writing the same checkpoint file at once: the pieces of two writers interleave."""
    path = Path(os.environ.get("GALLERY_TMP", tempfile.gettempdir())) / "model.pt"  # a folder all ranks see
    state = {"rank": rank, "weights": torch.full((100_000,), float(rank))}  # what each rank would save
    if variant == "broken":
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getvalue()
        if rank == 0:
            open(path, "wb").close()
        dist.barrier()
        with open(path, "r+b") as f:  # both ranks write the same file
            for piece, start in enumerate(range(0, len(data), 65536)):
                if piece % 2 == rank:  # taking turns, as two writers would by chance on a shared file system
                    f.seek(start)
                    f.write(data[start:start + 65536])
                    f.flush()
                dist.barrier()
    else:
        if rank == 0:  # one writer, through a temporary file and a rename: readers never see half a file
            torch.save(state, f"{path}.tmp")
            os.replace(f"{path}.tmp", path)
        dist.barrier()  # nobody reads before it is written
    loaded = torch.load(path, weights_only=True)  # every rank reads it back
    values = sorted(set(loaded["weights"].tolist()))
    if len(values) > 1:
        raise RuntimeError(f"torn checkpoint: {path} loads, but its weights mix the ranks' writes {values}")
    if rank == 0:
        print(f"rank 0 wrote, every rank read the weights of rank {loaded['rank']}: all {values[0]:g}")


def eval_through_wrapper(rank, variant):
    """Evaluation under no_grad through the DDP wrapper: the first forward after a training step broadcasts the
    buffers. A rank with no evaluation batch leaves that broadcast without a partner."""
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(10, 10), nn.BatchNorm1d(10), nn.Linear(10, 1)))
    model(torch.randn(8, 10)).sum().backward()  # a training step: the next forward will sync the buffers
    batches = [torch.randn(8, 10) for _ in range(3 if rank == 0 else 1)]  # uneven, but nobody empty
    with torch.no_grad():
        for x in batches if variant == "fixed" else (batches if rank == 0 else []):  # broken: rank 1 has none
            model(x)
    total = torch.tensor([float(len(batches))])
    dist.all_reduce(total)  # the metrics: the next collective every rank calls
    if variant == "fixed":
        with torch.no_grad():  # and the course's way, through model.module: no hidden collective
            for x in batches if rank == 0 else []:
                model.module(x)
        dist.all_reduce(total)
    if rank == 0:
        print(f"uneven evaluation batches (3 and 1) through the wrapper: fine; metrics {total.item():g}")


# Gloo's timeout in the words of whichever rank notices it first; the other rank then sees its peer gone
GLOO_TIMEOUT = ("Timed out waiting", "Application timeout caused pair closure")
INPLACE = "modified by an inplace operation"  # torch 2.11.0 raises it; torch 2.14.1 runs the broken variant
CASES = {  # name: (the case, the message its broken variant ends with)
    "unused-parameters": (unused_parameters,
                          "Expected to have finished reduction in the prior iteration before starting a new one"),
    "uneven-inputs": (uneven_inputs, GLOO_TIMEOUT),
    "inplace-buffers": (inplace_buffers, INPLACE),
    "different-models": (different_models, "appears not to match sizes of the same param in process 0"),
    "no-process-group": (no_process_group,
                         "Default process group has not been initialized, please make sure to call init_process_group"),
    "after-destroy": (after_destroy, "Default process group has not been initialized"),
    "racing-checkpoint": (racing_checkpoint, "torn checkpoint"),
    "eval-through-wrapper": (eval_through_wrapper, GLOO_TIMEOUT),
}


def run_case(name, variant):
    """One rank's part of one case, in a process started as torchrun starts its workers (RANK, WORLD_SIZE, ...)."""
    hangs = variant == "broken" and CASES[name][1] == GLOO_TIMEOUT
    if name != "no-process-group":
        # meeting (the rendezvous and Gloo's connections) may take PATIENT seconds: a rank starts late on busy cores
        # (the gallery starts 16 at once). Only then do the collectives of a variant that hangs get TIMEOUT.
        dist.init_process_group("gloo", timeout=timedelta(seconds=PATIENT))
        if hangs:
            from torch.distributed.distributed_c10d import _set_pg_timeout  # not public; in torch 2.11 and later

            _set_pg_timeout(timedelta(seconds=TIMEOUT))
    try:
        CASES[name][0](int(os.environ["RANK"]), variant)
        if dist.is_initialized():
            dist.barrier()  # every rank finishes its work before any tears the group down
    finally:
        gc.collect()  # a workaround, not DDP: free the DDP model (it lives in reference cycles) before its group
        if dist.is_initialized():
            dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=CASES)
    parser.add_argument("variant", choices=("broken", "fixed"))
    args = parser.parse_args()
    if "RANK" not in os.environ:
        parser.error(f"start me with torchrun, e.g. torchrun --standalone --nproc-per-node 2 {__file__} "
                     f"{args.case} {args.variant}")
    run_case(args.case, args.variant)


if __name__ == "__main__":
    main()
