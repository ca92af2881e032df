#!/usr/bin/env python3
"""Writes small learnable data sets in the formats ps-worker reads besides
IDX, with the Python standard library only (no numpy needed):

  DIR/npz/train.npz, DIR/npz/test.npz   3x8x8 uint8 images, NHWC, 4 classes;
      x stored and y deflated, with zip64 local headers as numpy's savez
      writes them
  DIR/cifar/data_batch_1..5.bin, DIR/cifar/test_batch.bin   CIFAR-10 binary
      records (label byte + 3x32x32 channel-major pixels), 10 classes

Each class is a fixed random template on a coarse grid of cells plus
per-example noise, so a small CNN learns it in seconds.

  write_data_formats.py DIR
"""
import io
import os
import random
import struct
import sys
import zipfile


def templates(rng, classes, c, h, w, cell):
    out = []
    for _ in range(classes):
        grid = [[[rng.randrange(20, 236) for _ in range(w // cell)]
                 for _ in range(h // cell)] for _ in range(c)]
        out.append([[[grid[ch][y // cell][x // cell] for x in range(w)]
                     for y in range(h)] for ch in range(c)])
    return out


def example(rng, tmpl, noise=40):
    """(label, planes[c][h][w]) of one noisy example of a random class."""
    label = rng.randrange(len(tmpl))
    t = tmpl[label]
    return label, [[[min(255, max(0, v + rng.randrange(-noise, noise + 1))) for v in row]
                    for row in plane] for plane in t]


def npy(descr, shape, payload):
    """A .npy file, version 1.0, header padded to 64 bytes as numpy does."""
    d = "{'descr': '%s', 'fortran_order': False, 'shape': %s, }" % (descr, shape)
    hlen = len(d) + 1
    hlen += (64 - (10 + hlen) % 64) % 64
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", hlen) + (d.ljust(hlen - 1) + "\n").encode() + payload


def write_npz(path, rng, tmpl, n):
    c, h, w = len(tmpl[0]), len(tmpl[0][0]), len(tmpl[0][0][0])
    pixels, labels = bytearray(), []
    for _ in range(n):
        label, planes = example(rng, tmpl)
        labels.append(label)
        for y in range(h):  # NHWC
            for x in range(w):
                pixels.extend(planes[ch][y][x] for ch in range(c))
    x = npy("|u1", "(%d, %d, %d, %d)" % (n, h, w, c), bytes(pixels))
    y = npy("<i8", "(%d,)" % n, struct.pack("<%dq" % n, *labels))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        with z.open(zipfile.ZipInfo("x.npy"), "w", force_zip64=True) as f:
            f.write(x)
        info = zipfile.ZipInfo("y.npy")
        info.compress_type = zipfile.ZIP_DEFLATED
        with z.open(info, "w", force_zip64=True) as f:
            f.write(y)
    with open(path, "wb") as f:
        f.write(buf.getvalue())


def write_cifar(path, rng, tmpl, n):
    with open(path, "wb") as f:
        for _ in range(n):
            label, planes = example(rng, tmpl)
            f.write(bytes([label]) + bytes(v for plane in planes for row in plane for v in row))


def main():
    out = sys.argv[1]
    rng = random.Random(20240611)
    os.makedirs(os.path.join(out, "npz"), exist_ok=True)
    small = templates(rng, 4, 3, 8, 8, 2)
    write_npz(os.path.join(out, "npz", "train.npz"), rng, small, 1024)
    write_npz(os.path.join(out, "npz", "test.npz"), rng, small, 256)
    os.makedirs(os.path.join(out, "cifar"), exist_ok=True)
    cifar = templates(rng, 10, 3, 32, 32, 8)
    for k in range(1, 6):
        write_cifar(os.path.join(out, "cifar", "data_batch_%d.bin" % k), rng, cifar, 120)
    write_cifar(os.path.join(out, "cifar", "test_batch.bin"), rng, cifar, 200)


if __name__ == "__main__":
    main()
