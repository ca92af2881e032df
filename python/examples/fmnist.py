"""Fashion-MNIST from the IDX files (Debian's dataset-fashion-mnist), as NumPy
arrays: images float32 (n, 1, 28, 28) in [0, 1] (as ps-worker scales them),
labels int64 (n)."""
import gzip
import os

import numpy as np

DIR = os.environ.get("FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist")


def _idx(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load(split, directory=DIR):
    """(images, labels) of split "train" or "test"."""
    prefix = "train" if split == "train" else "t10k"
    x = _idx(os.path.join(directory, f"{prefix}-images-idx3-ubyte.gz"))
    y = _idx(os.path.join(directory, f"{prefix}-labels-idx1-ubyte.gz"))
    return (x.astype(np.float32) / 255.0).reshape(-1, 1, 28, 28), y.astype(np.int64)
