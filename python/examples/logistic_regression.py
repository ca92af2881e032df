"""Softmax regression on Fashion-MNIST in NumPy on the parameter servers (a flat job:
deploy/jobs/fashion_mnist_logreg.json, W (10, 784) and b (10) on the shards, Adam there):
  python3 -m psclient.cluster --job deploy/jobs/fashion_mnist_logreg.json --servers 2 \
      --workers 2 -- python3 python/examples/logistic_regression.py"""
import json
import os
import sys

import numpy as np

import psclient

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fmnist  # noqa: E402

tf = json.loads(os.environ.get("TF_CONFIG", "{}"))  # psclient.cluster sets it; or use --ps
k, n = tf.get("task", {}).get("index", 0), len(tf.get("cluster", {}).get("worker", [0]))
w = psclient.connect(sys.argv[1] if len(sys.argv) > 1 else None, insecure=True)
W, b, gW, gb = w.view("w"), w.view("b"), w.view("w", w.grads), w.view("b", w.grads)
x, y = fmnist.load("train")
x, rng, bs = x.reshape(len(x), -1), np.random.default_rng(k), w.job["batch_size"]
for epoch in range(w.job["epochs"]):
    mine = rng.permutation(np.arange(k, len(x), n))
    for i in np.array_split(mine, len(mine) // bs):
        w.pull()                                          # W and b, in place
        z = x[i] @ W.T + b
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        p[np.arange(len(i)), y[i]] -= 1                   # d(mean cross-entropy)/dz * len(i)
        gW[...], gb[...] = p.T @ x[i] / len(i), p.mean(0)  # into w.grads
        w.push(batch_size=len(i))
if k == 0:
    tx, ty = fmnist.load("test")
    w.pull()
    acc = ((tx.reshape(len(tx), -1) @ W.T + b).argmax(1) == ty).mean()
    print(f"final test accuracy {acc:.4f} ({len(ty)} examples)")
w.close()
