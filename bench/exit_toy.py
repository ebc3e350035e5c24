"""A finished 2-rank DDP job whose DDP model is still alive when the process group is destroyed: does it abort at exit?

    torchrun --standalone --nproc-per-node 2 bench/exit_toy.py        # frees the model first (gc.collect())
    COURSE_WORKAROUNDS=off torchrun --standalone --nproc-per-node 2 bench/exit_toy.py   # leaves it to exit

The model lives in a Trainer object, as pytorch/examples' scripts keep it, and a DDP model sits in reference cycles,
so `del` alone does not free it: only the garbage collector does, at interpreter shutdown unless called earlier.
`make free-stress` (bench/stress.py free) runs it many times each way and records how often it aborts.
"""

import argparse
import gc
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class Trainer:
    def __init__(self):
        self.model = DDP(torch.nn.Sequential(torch.nn.Linear(20, 20), torch.nn.ReLU(), torch.nn.Linear(20, 1)))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)

    def train(self, steps: int = 20):
        for _ in range(steps):
            loss = self.model(torch.randn(8, 20)).pow(2).mean()
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()


def main():
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    trainer = Trainer()
    trainer.train()
    del trainer
    if os.environ.get("COURSE_WORKAROUNDS", "on") != "off":
        gc.collect()  # the DDP model goes now, while its process group is still there
    dist.destroy_process_group()
    print(f"rank {int(os.environ['RANK'])} done", flush=True)


if __name__ == "__main__":
    main()
