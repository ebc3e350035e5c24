"""What SyncBatchNorm computes, written with one all_reduce: batch statistics over ALL ranks' samples.

PyTorch's nn.SyncBatchNorm only trains on GPUs. This module does the same on any backend: each
rank sums x and x*x over its own samples, one all_reduce adds the sums of every rank, and all
ranks normalise with the global mean and variance. Gradients flow back through the all_reduce.

    torchrun --standalone --nproc-per-node 2 06_amp_syncbn/syncbn_by_hand.py    # the proof
    torchrun --standalone --nproc-per-node 2 06_amp_syncbn/syncbn_by_hand.py --device cuda   # + nn.SyncBatchNorm
    make syncbn-proof NPROC=3

The proof: every rank holds a slice of one global batch; the outputs, the input gradients and the
running statistics equal those of nn.BatchNorm2d run on the whole batch in one process. It runs on the
CPU with Gloo by default, on any machine. With --device cuda (NCCL with a GPU per process, or
--backend gloo to share GPUs) nn.SyncBatchNorm is held to the same account, next to this module.
"""

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import common


class SumOverRanks(torch.autograd.Function):
    """all_reduce(SUM) that autograd can go through.

    Every rank's output depends on every rank's input, so in backward each rank's input
    gradient is the sum of all ranks' output gradients: an all_reduce again.
    """

    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class AllReduceBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm2d whose training statistics cover the samples of every rank in the process group."""

    def forward(self, x):
        if not self.training:  # evaluation uses the running statistics, as plain BatchNorm does
            return super().forward(x)
        count = torch.full((1,), x.numel() / x.shape[1], dtype=x.dtype, device=x.device)
        local = torch.cat([x.sum((0, 2, 3)), (x * x).sum((0, 2, 3)), count])  # [sum | sum of squares | n]
        total = SumOverRanks.apply(local)  # one all_reduce for all three statistics
        c = x.shape[1]
        n = total[2 * c]
        mean = total[:c] / n
        var = total[c:2 * c] / n - mean * mean  # biased, as used for normalising
        with torch.no_grad():
            self.num_batches_tracked += 1
            m = self.momentum
            self.running_mean.mul_(1 - m).add_(m * mean.detach())
            self.running_var.mul_(1 - m).add_(m * var.detach() * n / (n - 1))  # unbiased, as BatchNorm stores
        shape = (1, c, 1, 1)
        y = (x - mean.view(shape)) / torch.sqrt(var.view(shape) + self.eps)
        return y * self.weight.view(shape) + self.bias.view(shape)


def convert_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every nn.BatchNorm2d in `module` by AllReduceBatchNorm2d, keeping weights and statistics."""
    for name, child in module.named_children():
        if isinstance(child, nn.BatchNorm2d) and not isinstance(child, AllReduceBatchNorm2d):
            new = AllReduceBatchNorm2d(child.num_features, child.eps, child.momentum, child.affine)
            new.load_state_dict(child.state_dict())
            setattr(module, name, new)
        else:
            convert_batchnorm(child)
    return module


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-rank", type=int, default=4, help="samples per rank")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cuda: on GPUs, with nn.SyncBatchNorm compared too (default %(default)s)")
    parser.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])  # torchrun sets it, with RANK, WORLD_SIZE and LOCAL_WORLD_SIZE
    device, backend = common.device_and_backend(args.device, args.backend, local_rank,
                                                int(os.environ["LOCAL_WORLD_SIZE"]))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout),
                            device_id=device if backend == "nccl" else None)
    try:
        rank, ws = dist.get_rank(), dist.get_world_size()
        g = torch.Generator().manual_seed(0)  # every rank builds the same global batch and upstream gradient
        x_all = (torch.randn(ws * args.per_rank, 3, 5, 5, generator=g) * 2 + 1).to(device)
        up_all = torch.randn(x_all.shape, generator=g).to(device)
        mine = slice(rank * args.per_rank, (rank + 1) * args.per_rank)

        reference = nn.BatchNorm2d(3).to(device)  # one process, the whole batch
        x_ref = x_all.clone().requires_grad_()
        y_ref = reference(x_ref)
        (y_ref * up_all).sum().backward()

        def differences(layer):
            """Run `layer` on this rank's slice; how far it lands from the whole-batch reference, on every rank."""
            x = x_all[mine].clone().requires_grad_()
            y = layer(x)
            (y * up_all[mine]).sum().backward()
            diffs = {"output": (y - y_ref[mine]).abs().max().item(),
                     "input_grad": (x.grad - x_ref.grad[mine]).abs().max().item(),
                     "running_mean": (layer.running_mean - reference.running_mean).abs().max().item(),
                     "running_var": (layer.running_var - reference.running_var).abs().max().item()}
            worst = torch.tensor([max(diffs.values())], device=device)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # the worst rank: each must hold the global statistics
            return diffs, worst.item()

        by_hand = AllReduceBatchNorm2d(3).to(device)
        diffs, worst = differences(by_hand)  # this rank, its slice only
        local = nn.BatchNorm2d(3).to(device)(x_all[mine])  # plain BatchNorm on the slice, for contrast
        plain = torch.tensor([(local - y_ref[mine]).abs().max().item()], device=device)
        dist.all_reduce(plain, op=dist.ReduceOp.MAX)
        lines = [f"{ws} ranks x {args.per_rank} samples vs nn.BatchNorm2d on all {ws * args.per_rank} "
                 f"({backend}, {device.type}):"]
        lines += [f"  {key:<13} max |difference| on rank 0: {value:.2e}" for key, value in diffs.items()]
        lines.append(f"  plain BatchNorm2d on one rank's slice differs by {plain.item():.2e}")
        lines.append("  rank 0's running statistics: mean " + " ".join(f"{v:.7f}" for v in by_hand.running_mean)
                     + ", var " + " ".join(f"{v:.7f}" for v in by_hand.running_var))
        result = f"result: max_diff={worst:.3e} plain_diff={plain.item():.3e}"
        ok = worst < 1e-5
        if device.type == "cuda":  # PyTorch's own, which trains on GPUs only
            _, sync_worst = differences(nn.SyncBatchNorm(3).to(device))
            lines.append(f"  nn.SyncBatchNorm, worst over output, gradient, statistics and ranks: {sync_worst:.2e}")
            result += f" syncbn_diff={sync_worst:.3e}"
            ok = ok and sync_worst < 1e-5
        if rank == 0:
            print("\n".join([*lines, f"{result} equal={ok}"]), flush=True)
        dist.barrier()  # every rank finishes its work before any tears the group down
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
