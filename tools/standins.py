"""The offline stand-ins: generated, learnable, deterministic data sets in MNIST's and CIFAR-10's own file formats.

No training script imports this file: tools/data.py does, and writes a stand-in through it when one is needed (the
first run, or when a file of it is missing or damaged). common.load_dataset reads the files, as it reads real data;
torchvision's own MNIST and CIFAR10 classes read them too (a test compares the two).

- MNIST stand-in: 24,000 + 4,000 handwriting-like digits, drawn from two 7x5 glyphs per digit with random
  rotation, scale, shear, shift, stroke width, wobble, a stray stroke in a third of them, and noise. Hard enough
  that the ConvNet reaches about 96 % after one epoch, not 100 % at once.
- CIFAR-10 stand-in: 10,000 + 2,000 32x32 RGB images of ten shape and texture classes.

Each writer finishes with a manifest of the files and their sizes, which common.prepare_data checks.
"""

from __future__ import annotations

import json
import math
import pickle
import struct
from pathlib import Path

import torch
import torch.nn.functional as F

from tools.util import atomic_write_bytes

CIFAR_STANDIN_FOLDER = "cifar-10-standin-py"
STANDIN_MANIFEST = "MANIFEST.json"  # each stand-in folder: its files and their sizes, written last

STANDIN_SIZES = {"mnist": (24000, 4000), "cifar10": (10000, 2000)}  # (train, test) images

# Digit glyphs, 7 rows x 5 columns, two hand styles each; '#' is ink.
_GLYPHS = {
    0: [" ### ,#   #,#  ##,# # #,##  #,#   #, ### ", " ### ,#   #,#   #,#   #,#   #,#   #, ### "],
    1: ["  #  , ##  ,  #  ,  #  ,  #  ,  #  , ### ", "   # ,  ## , # # ,   # ,   # ,   # ,   # "],
    2: [" ### ,#   #,    #,   # ,  #  , #   ,#####", " ### ,#   #,    #,  ## , #   ,#    ,#####"],
    3: ["#####,   # ,  #  ,   # ,    #,#   #, ### ", " ### ,#   #,    #,  ## ,    #,#   #, ### "],
    4: ["   # ,  ## , # # ,#  # ,#####,   # ,   # ", "#   #,#   #,#   #,#####,    #,    #,    #"],
    5: ["#####,#    ,#### ,    #,    #,#   #, ### ", "#####,#    ,#    ,#### ,    #,    #,#### "],
    6: ["  ## , #   ,#    ,#### ,#   #,#   #, ### ", " ### ,#    ,#    ,#### ,#   #,#   #, ### "],
    7: ["#####,    #,   # ,  #  , #   , #   , #   ", "#####,    #,   # , ### ,  #  ,  #  ,  #  "],
    8: [" ### ,#   #,#   #, ### ,#   #,#   #, ### ", " ### ,#   #, # # ,  #  , # # ,#   #, ### "],
    9: [" ### ,#   #,#   #, ####,    #,   # , ##  ", " ### ,#   #,#   #, ####,    #,    #, ### "],
}


def _glyph_bank() -> torch.Tensor:
    """(10, styles, 1, 7, 5) float tensor of the digit bitmaps."""
    bank = [[[[c == "#" for c in row] for row in style.split(",")] for style in _GLYPHS[d]] for d in range(10)]
    return torch.tensor(bank, dtype=torch.float32).unsqueeze(2)


def make_mnist_standin(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` handwriting-like 28x28 uint8 digits and their labels, deterministic for a seed.

    Each image is a bitmap glyph warped by a random affine map and a smooth random
    displacement field, with random stroke width, blur, clutter and noise: learnable, but
    hard enough that a small ConvNet does not reach 100 % at once.
    """
    g = torch.Generator().manual_seed(seed)
    bank = _glyph_bank()
    labels = torch.randint(0, 10, (n,), generator=g)
    styles = torch.randint(0, bank.shape[1], (n,), generator=g)
    images = torch.empty(n, 28, 28, dtype=torch.uint8)
    for start in range(0, n, 4096):
        sl = slice(start, min(n, start + 4096))
        m = sl.stop - sl.start
        glyph = bank[labels[sl], styles[sl]]  # (m, 1, 7, 5)
        canvas = F.pad(F.interpolate(glyph, size=(20, 14), mode="bilinear", align_corners=False), (7, 7, 4, 4))
        thick = torch.rand(m, generator=g) < 0.5  # bolder pen for half of them
        canvas = torch.where(thick.view(m, 1, 1, 1), F.max_pool2d(canvas, 3, 1, 1), canvas)
        angle = (torch.rand(m, generator=g) - 0.5) * math.radians(40)
        scale = 0.8 + 0.4 * torch.rand(m, generator=g)
        shear = (torch.rand(m, generator=g) - 0.5) * 0.6
        shift = (torch.rand(m, 2, generator=g) - 0.5) * 0.35
        cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
        theta = torch.stack([torch.stack([cos, -sin + shear, shift[:, 0]], 1),
                             torch.stack([sin, cos, shift[:, 1]], 1)], 1)
        grid = F.affine_grid(theta, (m, 1, 28, 28), align_corners=False)
        wobble = F.interpolate(torch.randn(m, 2, 4, 4, generator=g) * 0.08, size=(28, 28), mode="bicubic",
                               align_corners=False).permute(0, 2, 3, 1)
        img = F.grid_sample(canvas, grid + wobble, mode="bilinear", padding_mode="zeros", align_corners=False)
        # clutter: a stray stroke in a third of the images
        stray = torch.zeros(m, 1, 28, 28)
        rows = torch.randint(0, 28, (m,), generator=g)
        cols = torch.randint(0, 20, (m,), generator=g)
        has = torch.rand(m, generator=g) < 0.33
        for k in range(6):
            stray[torch.arange(m), 0, rows, (cols + k).clamp(max=27)] = has.float() * 0.8
        img = torch.maximum(img, stray)
        img = F.avg_pool2d(F.pad(img, (1, 1, 1, 1), mode="replicate"), 3, 1) * 0.6 + img * 0.4  # soft ink
        img = img * (0.6 + 0.4 * torch.rand(m, 1, 1, 1, generator=g)) + 0.12 * torch.randn(img.shape, generator=g)
        images[sl] = (img.clamp(0, 1) * 255).round().to(torch.uint8).squeeze(1)
    return images, labels


def make_cifar_standin(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` 32x32 RGB uint8 images (N, 32, 32, 3) of ten procedural classes, and labels.

    Each class is a shape or texture (disc, square, ring, cross, stripes, checks, ...) with
    random colour, size, position, background and noise.
    """
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    yy, xx = torch.meshgrid(torch.linspace(-1, 1, 32), torch.linspace(-1, 1, 32), indexing="ij")
    cx, cy = [(torch.rand(n, 1, 1, generator=g) - 0.5) * 0.8 for _ in range(2)]
    r = 0.35 + 0.3 * torch.rand(n, 1, 1, generator=g)
    x, y = xx - cx, yy - cy
    freq = 6 + 6 * torch.rand(n, 1, 1, generator=g)
    masks = torch.stack([
        (x**2 + y**2 < r**2).float(),                                          # disc
        ((x.abs() < r) & (y.abs() < r)).float(),                               # square
        ((x**2 + y**2 < r**2) & (x**2 + y**2 > (0.6 * r) ** 2)).float(),       # ring
        (((x.abs() < r / 4) & (y.abs() < r)) | ((y.abs() < r / 4) & (x.abs() < r))).float(),  # cross
        (torch.sin(freq * yy) > 0).float(),                                    # horizontal stripes
        (torch.sin(freq * xx) > 0).float(),                                    # vertical stripes
        (torch.sin(freq * (xx + yy) / 1.4) > 0).float(),                       # diagonal stripes
        ((torch.sin(freq * xx) > 0) ^ (torch.sin(freq * yy) > 0)).float(),     # checks
        ((y > -r) & (y < r) & (x.abs() < (y + r) / 2)).float(),                # triangle
        ((x.abs() + y.abs()) < r).float(),                                     # diamond
    ], 1)
    mask = masks[torch.arange(n), labels].unsqueeze(1)  # (n, 1, 32, 32)
    fg = torch.rand(n, 3, 1, 1, generator=g)
    bg = torch.rand(n, 3, 1, 1, generator=g)
    bg = torch.where((fg - bg).abs().sum(1, keepdim=True) < 0.6, 1 - fg, bg)  # keep the shape visible
    img = mask * fg + (1 - mask) * bg + 0.1 * torch.randn(n, 3, 32, 32, generator=g)
    img = (img.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()
    return img, labels


def _idx_bytes(t: torch.Tensor) -> bytes:
    """A uint8 tensor in MNIST's IDX format (magic 0x0000080N, big-endian sizes, raw bytes)."""
    header = struct.pack(">HBB", 0, 0x08, t.dim()) + struct.pack(f">{t.dim()}I", *t.shape)
    return header + t.numpy().tobytes()


def write_mnist_standin(root, sizes=None, seed: int = 1234) -> Path:
    """Write the MNIST stand-in as IDX files under root/MNIST/raw (where the real MNIST's files are)."""
    raw = Path(root) / "MNIST" / "raw"
    n_train, n_test = sizes or STANDIN_SIZES["mnist"]
    for prefix, n, s in (("train", n_train, seed), ("t10k", n_test, seed + 1)):
        images, labels = make_mnist_standin(n, s)
        atomic_write_bytes(_idx_bytes(images), raw / f"{prefix}-images-idx3-ubyte")
        atomic_write_bytes(_idx_bytes(labels.to(torch.uint8)), raw / f"{prefix}-labels-idx1-ubyte")
    write_manifest(raw)
    return raw


CIFAR_CLASSES = ["disc", "square", "ring", "cross", "h-stripes", "v-stripes", "d-stripes", "checks",
                 "triangle", "diamond"]


def write_cifar_standin(root, sizes=None, seed: int = 4321) -> Path:
    """Write the CIFAR-10 stand-in as pickled batches, in CIFAR-10's own python format."""
    folder = Path(root) / CIFAR_STANDIN_FOLDER
    n_train, n_test = sizes or STANDIN_SIZES["cifar10"]
    train_x, train_y = make_cifar_standin(n_train, seed)
    test_x, test_y = make_cifar_standin(n_test, seed + 1)

    def batch(x, y, name):  # CIFAR rows are 3072 bytes: the R plane, then G, then B
        return {"batch_label": name, "labels": y.tolist(), "data": x.permute(0, 3, 1, 2).reshape(len(x), -1).numpy(),
                "filenames": [f"{name}_{i}.png" for i in range(len(x))]}

    for i, part in enumerate(torch.arange(n_train).chunk(5)):
        atomic_write_bytes(pickle.dumps(batch(train_x[part], train_y[part], f"training batch {i + 1} of 5")),
                           folder / f"data_batch_{i + 1}")
    atomic_write_bytes(pickle.dumps(batch(test_x, test_y, "testing batch 1 of 1")), folder / "test_batch")
    meta = {"label_names": CIFAR_CLASSES, "num_cases_per_batch": n_train // 5, "num_vis": 3072}
    atomic_write_bytes(pickle.dumps(meta), folder / "batches.meta")
    write_manifest(folder)
    return folder


def write_manifest(folder: Path) -> Path:
    """List every file of a stand-in with its size, last: a complete manifest means a complete write."""
    sizes = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.name != STANDIN_MANIFEST and p.is_file()}
    return atomic_write_bytes((json.dumps(sizes, indent=1) + "\n").encode(), folder / STANDIN_MANIFEST)
