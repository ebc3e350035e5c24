"""Mixed precision: training images/s in fp32 vs bf16 autocast (and, on CUDA, TF32 and fp16 with GradScaler),
for the course's ConvNet (MNIST-shaped) and ResNet-18 (CIFAR-shaped), one process, data already on the device.

On Ampere and newer GPUs, "fp32" convolutions run in TF32 by default (torch.backends.cudnn.conv.fp32_precision
is "tf32"): here fp32 means true fp32 (TF32 off for matmuls and convolutions), and tf32 is its own variant.
The flags each variant ran with are recorded in the results.

Autocast runs matrix multiplications and convolutions in the lower precision where the hardware has fast
units for it (tensor cores on recent GPUs; some CPUs have bf16 instructions, many do not). Whether it pays
is a measurement, not a rule: this script takes it. Every (model, precision) pair runs once per round, in
a rotating order; the ratio to fp32 is computed inside each round.

    python bench/amp.py              # the full set (about 40 s on 2 CPU cores)
    python bench/amp.py --quick      # tiny batches, 1 round: checks that everything runs
    make bench-amp
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

import benchlib
import common
from tools import course

MODELS = {  # name: (builder, input shape, CPU batch, GPU batch, CPU steps, GPU steps)
    "convnet": (common.ConvNet, (1, 28, 28), 64, 512, 150, 100),
    "resnet18": (common.resnet18_cifar, (3, 32, 32), 32, 256, 4, 30),
}
PRECISIONS = {"fp32": None, "tf32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def fp32_math(precision: str) -> str:
    """Set how CUDA computes fp32 matmuls and convolutions for this variant; return the setting.

    "ieee" is true fp32; "tf32" uses tensor cores with a 10-bit mantissa. Autocast variants keep torch's
    defaults (matmul ieee, convolution tf32) for what stays in fp32.
    """
    mode = {"fp32": "ieee", "tf32": "tf32"}.get(precision)
    if mode is None:
        mode = "default"
        torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = "ieee", "tf32"
    else:
        torch.backends.cuda.matmul.fp32_precision = torch.backends.cudnn.conv.fp32_precision = mode
    return mode


def make_runner(model_name: str, precision: str, batch: int, cfg: dict, device: torch.device):
    build, shape, *_ = MODELS[model_name]
    dtype = PRECISIONS[precision]
    g = torch.Generator().manual_seed(0)
    images = torch.randn(batch, *shape, generator=g).to(device)
    labels = torch.randint(0, 10, (batch,), generator=g).to(device)

    def run() -> dict:
        common.seed_everything(0)
        torch.backends.cudnn.deterministic = False  # a speed measurement: let cuDNN pick its fastest
        torch.backends.cudnn.benchmark = device.type == "cuda"
        math_mode = fp32_math(precision) if device.type == "cuda" else "cpu"
        model = build().to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None

        def step() -> int:
            with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            if scaler is None:
                loss.backward()
                optimizer.step()
            else:  # fp16 gradients underflow without loss scaling
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            return batch

        n, seconds = benchlib.time_steps(step, cfg["warmup"], cfg["steps"][model_name], device)
        return {"images_per_s": n / seconds, "loss": float(loss_of(model, images, labels)),
                "fp32_math": math_mode}

    return run


@torch.no_grad()
def loss_of(model, images, labels) -> torch.Tensor:
    """The fp32 loss after training: a finite number shows the run did not diverge."""
    model.eval()
    return F.cross_entropy(model(images).float(), labels)


def main(argv=None):
    parser = benchlib.make_parser(__doc__, "batch 4, 2 steps, 1 round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before each measurement")
    parser.add_argument("--models", default="convnet,resnet18", help="comma-separated: convnet, resnet18")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown or not models:
        parser.error(f"--models: unknown {unknown or 'empty'}; choose from {', '.join(MODELS)}")
    if args.warmup < 0:
        parser.error("--warmup must be at least 0")
    try:
        device, _ = common.device_and_backend(args.device, "gloo")  # one process: the backend is not used
    except RuntimeError as err:
        parser.error(str(err))
    cuda = device.type == "cuda"
    precisions = ["fp32", "tf32", "bf16", "fp16"] if cuda else ["fp32", "bf16"]
    if cuda and not torch.cuda.is_bf16_supported(including_emulation=False):  # emulated bf16 is no speed-up
        precisions.remove("bf16")
    if cuda and torch.cuda.get_device_capability(device) < (8, 0):  # TF32 needs Ampere or newer
        precisions.remove("tf32")
    if args.quick:
        args.rounds, args.warmup = 1, 1
    batches = {m: 4 if args.quick else MODELS[m][3 if cuda else 2] for m in models}
    cfg = {"device": device.type, "warmup": args.warmup, "batch": batches, "threads": torch.get_num_threads(),
           "steps": {m: 2 if args.quick else MODELS[m][5 if cuda else 4] for m in models}}
    runners = {(m, p): make_runner(m, p, batches[m], cfg, device) for m in models for p in precisions}
    course.say(f"{', '.join(models)} x {', '.join(precisions)} on {device.type} "
               f"({torch.cuda.get_device_name(device) if cuda else benchlib.cpu_model()}), {args.rounds} round(s)")
    per_round = benchlib.run_rounds({"/".join(key): run for key, run in runners.items()}, args.rounds)
    rounds, losses = benchlib.column(per_round), benchlib.column(per_round, "loss")[-1]
    cfg["fp32_math"] = benchlib.column(per_round, "fp32_math")[-1]  # how each variant computed its fp32 ops
    report(args, cfg, device, models, precisions, rounds, losses)


def report(args, cfg, device, models, precisions, rounds, losses):
    keys = [f"{m}/{p}" for m in models for p in precisions]
    results = {k: benchlib.summarize([r[k] for r in rounds]) for k in keys}
    ratios = {f"{m}/{p}_vs_fp32": {"meaning": f"{m}: {p} images/s vs fp32",
                                   **benchlib.summarize([r[f"{m}/{p}"] / r[f"{m}/fp32"] for r in rounds])}
              for m in models for p in precisions if p != "fp32"}
    machine = benchlib.machine_info(device)
    name = benchlib.stem("amp", device, None, args.quick)
    payload = {"bench": "amp", "machine": machine, "config": cfg, "quick": args.quick, "results": results,
               "ratios": ratios, "final_loss": losses, "per_round": rounds}
    md = [f"# Mixed precision, training images/s ({device.type})", "",
          f"{machine['gpu'] or machine['cpu']}, {machine['cores']} cores, torch {torch.__version__}; one process; "
          f"median (min-max) over {args.rounds} round(s); fp16 uses a GradScaler"
          + ("; fp32 is true fp32 (TF32 off), tf32 uses TF32 tensor cores" if device.type == "cuda" else "")
          + ". CPU features: "
          f"{', '.join(machine['cpu_flags']) or 'none of avx2, avx512f, avx512_bf16, amx_bf16'}.", ""]
    md += benchlib.md_table(["model", "batch", "precision", "images/s", "vs fp32", "loss after"],
                            [[k.split("/")[0], cfg["batch"][k.split("/")[0]], k.split("/")[1],
                              benchlib.fmt_range(results[k], 1),
                              "1.00" if k.endswith("fp32") else
                              f"{ratios[k + '_vs_fp32']['median']:.2f} "
                              f"({ratios[k + '_vs_fp32']['min']:.2f}-{ratios[k + '_vs_fp32']['max']:.2f})",
                              f"{losses[k]:.3f}"] for k in keys])
    out = Path(args.output_dir)
    paths = benchlib.write_results(out, name, payload, md)
    colors = [{"tf32": "tab:purple", "bf16": "tab:orange", "fp16": "tab:green"}[k.split("/")[1].split("_")[0]]
              for k in ratios]
    png = benchlib.bar_plot(out / f"{name}.png", [k.replace("_vs_fp32", "") for k in ratios], list(ratios.values()),
                            "images/s relative to fp32", f"autocast vs fp32, {device.type}", colors=colors,
                            hline=1.0, hline_label="fp32")
    course.say("\n".join(md))
    course.say("written: " + ", ".join(str(p) for p in paths + ([png] if png else [])))


if __name__ == "__main__":
    main()
