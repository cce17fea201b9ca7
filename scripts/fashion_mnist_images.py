#!/usr/bin/env python3
"""Fashion-MNIST as image files in class folders, the layout image_dataset_from_directory reads.

  fashion_mnist_images.py write OUT [--format png|jpeg] [--quality Q] [--limit N] [--rgb]
      OUT/train/<class>/<i>.<ext> and OUT/test/<class>/<i>.<ext>, i the image's position in its
      IDX split (zero-padded), <class> "0_tshirt_top" ... "9_ankle_boot" (sorted = label order).
      --limit N: the first N images of each split. --rgb: 3-channel files (grey repeated).
      --colour: colour files made from the grey (R = x, G = 255 - x, B = 3x mod 256), with
      alpha = x in PNG (RGBA), for the decoders' colour and alpha paths.
  fashion_mnist_images.py decode LIST OUT.safetensors [--mode L|RGB]
      Pillow's decode of the files listed in LIST (one path a line), stacked as uint8 [N, C, H, W]
      under "pixels" (what the tests compare flotilla's decoder with).

Needs Pillow and numpy (the test venv has both: scripts/bootstrap --test).
"""

import argparse
import gzip
import os
import struct

import numpy as np
from PIL import Image

CLASSES = ["0_tshirt_top", "1_trouser", "2_pullover", "3_dress", "4_coat", "5_sandal",
           "6_shirt", "7_sneaker", "8_bag", "9_ankle_boot"]
DATA = "/usr/share/datasets/fashion-mnist"


def read_idx(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        magic = struct.unpack(">I", f.read(4))[0]
        dims = struct.unpack(">" + "I" * (magic & 0xFF), f.read(4 * (magic & 0xFF)))
        return np.frombuffer(f.read(), dtype=np.uint8).reshape(dims)


def idx_file(data_dir, name):
    for candidate in (name + ".gz", name):
        path = os.path.join(data_dir, candidate)
        if os.path.exists(path):
            return path
    raise SystemExit("%s: has no %s[.gz]; install dataset-fashion-mnist or give --data-dir"
                     % (data_dir, name))


def write(args):
    ext = "png" if args.format == "png" else "jpg"
    for split, prefix in (("train", "train"), ("test", "t10k")):
        images = read_idx(idx_file(args.data_dir, prefix + "-images-idx3-ubyte"))
        labels = read_idx(idx_file(args.data_dir, prefix + "-labels-idx1-ubyte"))
        n = len(images) if args.limit is None else min(args.limit, len(images))
        for c in CLASSES:
            os.makedirs(os.path.join(args.out, split, c), exist_ok=True)
        for i in range(n):
            image = Image.fromarray(images[i])  # 2-D uint8: mode "L"
            if args.rgb:
                image = image.convert("RGB")
            if args.colour:
                x = images[i].astype(np.uint16)
                planes = [x, 255 - x, (3 * x) % 256] + ([x] if ext == "png" else [])
                image = Image.fromarray(np.stack(planes, axis=-1).astype(np.uint8))
            path = os.path.join(args.out, split, CLASSES[labels[i]], "%05d.%s" % (i, ext))
            if ext == "png":
                image.save(path)
            else:
                image.save(path, quality=args.quality)


def decode(args):
    import torch
    from safetensors.torch import save_file
    with open(args.list) as f:
        paths = [line.rstrip("\n") for line in f if line.strip()]
    pixels = []
    for p in paths:
        with Image.open(p) as image:
            a = np.asarray(image.convert(args.mode))
        pixels.append(a[None] if a.ndim == 2 else a.transpose(2, 0, 1))
    save_file({"pixels": torch.from_numpy(np.ascontiguousarray(np.stack(pixels)))}, args.out)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write")
    w.add_argument("out")
    w.add_argument("--format", choices=["png", "jpeg"], default="png")
    w.add_argument("--quality", type=int, default=90)
    w.add_argument("--limit", type=int)
    w.add_argument("--rgb", action="store_true")
    w.add_argument("--colour", action="store_true")
    w.add_argument("--data-dir", default=DATA)
    d = sub.add_parser("decode")
    d.add_argument("list")
    d.add_argument("out")
    d.add_argument("--mode", choices=["L", "RGB"], default="L")
    args = parser.parse_args()
    write(args) if args.command == "write" else decode(args)


if __name__ == "__main__":
    main()
