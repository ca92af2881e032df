"""The quickstart's CNN (deploy/jobs/fashion_mnist_cnn.json) in PyTorch, trained
by a Python worker on the parameter servers, on the job's own layout: Python
workers and C ps-workers can train the job together.

  python3 -m psclient.cluster --job deploy/jobs/fashion_mnist_cnn.json \
      --servers 2 --workers 2 -- python3 python/examples/fashion_mnist_cnn.py
  python3 python/examples/fashion_mnist_cnn.py --ps HOST:PORT --index 0 --num-workers 2
  python3 python/examples/fashion_mnist_cnn.py --local     # no servers: the same loop, torch's Adam

Worker k trains examples i with i % num_workers == k (reshuffled each epoch),
or with --leases the chunks shard 0 leases it (the job's lease_chunk); the
chief (index 0) evaluates the test split at the end. The lines marked `# ps`
are what the servers add to a plain PyTorch loop.
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fmnist  # noqa: E402


def cnn():
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))


def evaluate(model, x, y, batch=500):
    model.eval()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for i in range(0, len(x), batch):
            out = model(torch.from_numpy(x[i:i + batch]))
            t = torch.from_numpy(y[i:i + batch])
            loss += F.cross_entropy(out, t, reduction="sum").item()
            correct += (out.argmax(1) == t).sum().item()
    model.train()
    return correct / len(x), loss / len(x)


def batches(args, n, epoch, w):
    """This worker's batches of an epoch: index lists."""
    rng = np.random.default_rng(args.seed * 1000003 + epoch * 7919 + args.index)
    mine = np.arange(args.index, n, args.num_workers)
    mine = mine[rng.permutation(len(mine))]
    for i in range(0, len(mine), args.batch):
        yield mine[i:i + args.batch]


def lease_batches(args, n, w):
    """Batches of the chunks shard 0 leases this worker, over every epoch."""
    for lease in w.leases(n):
        idx = np.arange(lease.begin, lease.begin + lease.count)
        idx = idx[np.random.default_rng(lease.id).permutation(len(idx))]
        for i in range(0, len(idx), args.batch):
            yield idx[i:i + args.batch]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ps", help="a server (default: TF_CONFIG's)")
    p.add_argument("--index", type=int, help="this worker's index (default: TF_CONFIG's, or 0)")
    p.add_argument("--num-workers", type=int, help="workers sharing the data (default: TF_CONFIG's, or 1)")
    p.add_argument("--token-file", help="the job's token (default: $PS_TOKEN_FILE)")
    p.add_argument("--insecure", action="store_true", help="plaintext servers")
    p.add_argument("--epochs", type=int, help="default: the job's")
    p.add_argument("--max-steps", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch's threads (default 1)")
    p.add_argument("--leases", action="store_true", help="data in chunks leased from shard 0")
    p.add_argument("--local", action="store_true", help="no servers: torch's Adam (lr 0.001)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--metrics", help="append a JSON line with the figures")
    p.add_argument("--no-eval", action="store_true", help="the chief does not evaluate at the end")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tf = json.loads(os.environ.get("TF_CONFIG", "{}"))
    task = tf.get("task", {})
    if args.index is None:
        args.index = task.get("index", 0)
    if args.num_workers is None:
        c = tf.get("cluster", {})
        args.num_workers = max(len(c.get("worker", [])) + len(c.get("chief", [])), 1)

    x, y = fmnist.load("train")
    model = cnn()
    w = ps = opt = None
    epochs = args.epochs or 3
    if args.local:
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        import psclient                      # ps
        import psclient.torch                # ps
        w = psclient.connect(args.ps, token_file=args.token_file, insecure=args.insecure,  # ps
                             task_index=args.index)
        ps = psclient.torch.PSModule(model, w)  # ps
        args.batch = w.job.get("batch_size", args.batch)
        epochs = args.epochs or w.job.get("epochs", 1)
        print(f"worker {args.index}/{args.num_workers}: {w}", flush=True)
    chief = args.index == 0 and not args.no_eval

    def steps():
        if args.leases:
            yield from lease_batches(args, len(x), w)
        else:
            for epoch in range(epochs):
                yield from batches(args, len(x), epoch, w)

    t0, seen, step, loss_sum = time.perf_counter(), 0, 0, 0.0
    for idx in steps():
        xb, yb = torch.from_numpy(x[idx]), torch.from_numpy(y[idx])
        if ps:
            ps.pull()                        # ps
        loss = F.cross_entropy(model(xb), yb)
        if ps:
            ps.zero_grad()                   # ps
        else:
            opt.zero_grad()
        loss.backward()
        if ps:
            ps.push(batch_size=len(idx))     # ps
        else:
            opt.step()
        seen, step, loss_sum = seen + len(idx), step + 1, loss_sum + loss.item()
        if step % 200 == 0:
            print(f"step {step}: loss {loss_sum / 200:.4f}, {seen / (time.perf_counter() - t0):.0f} "
                  "examples/s", flush=True)
            loss_sum = 0.0
        if args.max_steps and step >= args.max_steps:
            break
    dt = time.perf_counter() - t0
    print(f"trained {step} steps, {seen} examples in {dt:.1f} s: {seen / dt:.0f} examples/s",
          flush=True)
    figures = {"worker": args.index, "steps": step, "examples": seen, "seconds": dt,
               "examples_per_s": seen / dt}
    if chief:
        if ps:
            ps.pull(wait=False)
        tx, ty = fmnist.load("test")
        acc, tl = evaluate(model, tx, ty)
        print(f"final test accuracy {acc:.4f} (test loss {tl:.4f}, {len(tx)} examples)", flush=True)
        figures.update(test_accuracy=acc, test_loss=tl)
    if args.metrics:
        with open(args.metrics, "a") as f:
            f.write(json.dumps(figures) + "\n")
    if w:
        w.close()


if __name__ == "__main__":
    main()
