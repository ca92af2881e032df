"""python.mixed: a PyTorch worker (psclient.torch) and a C ps-worker train the
quickstart's CNN together on the same 2 shards, each its half of
Fashion-MNIST: both workers' pushes are in the shards' versions, and the
parameters ps-worker saved at its end, put into the torch module through the
job's layout, give in PyTorch the test accuracy ps-worker printed (the same
model: conv2d weights (OC, IC, KH, KW) then bias, dense (OUT, IN) then bias,
flatten in (C, H, W) order). Also: the adapter's views (no copies), a
module that does not fit the layout refused, and a flat job made from a
module (psclient.torch.flat_job)."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import torch
import torch.nn.functional as F

from common import LocalCluster, check, find_program, psclient, raises, say

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "python", "examples"))
import fashion_mnist_cnn as example  # noqa: E402
import fmnist  # noqa: E402
import psclient.torch as pst  # noqa: E402

STEPS = 150


def check_adapter(w, model, ps, x, y):
    """Views, not copies; backward's gradients in w.grads; the order said."""
    for p, (_, t) in zip(model.parameters(), ps.placement):
        check(p.data_ptr() == w.params.ctypes.data + 4 * t.offset, f"{t.name}: a view of params")
        check(p.grad.data_ptr() == w.grads.ctypes.data + 4 * t.offset, f"{t.name}: grads")
    check(ps.describe().splitlines()[0] == "0.weight (32, 1, 3, 3) -> conv2d_0.w [0, 288)",
          ps.describe())
    ps.pull()
    ps.zero_grad()
    F.cross_entropy(model(x), y).backward()
    g = w.grads.copy()
    check(np.count_nonzero(g) > 0.5 * g.size, "backward wrote into w.grads")
    model.zero_grad(set_to_none=True)  # torch 2's default: the views are put back
    F.cross_entropy(model(x), y).backward()
    ps.push(batch_size=len(x))
    check(np.allclose(w.grads, g, rtol=1e-5, atol=1e-7), "zero_grad(set_to_none) survived")
    wrong = torch.nn.Sequential(torch.nn.Conv2d(1, 32, 3, padding=1), torch.nn.Flatten(),
                                torch.nn.Linear(25088, 10))
    e = raises(ValueError, pst.PSModule, wrong, w)
    check("do not match the job's tensors in order" in str(e) and "conv2d_1.w" in str(e), str(e))


def python_worker(c, out):
    x, y = fmnist.load("train")
    torch.manual_seed(1)
    model = example.cnn()
    w = psclient.connect(c.servers, insecure=True, task_index=1)
    ps = pst.PSModule(model, w)
    xb, yb = torch.from_numpy(x[1:65:2].copy()), torch.from_numpy(y[1:65:2].copy())
    check_adapter(w, model, ps, xb, yb)
    rng = np.random.default_rng(2)
    mine = np.arange(1, len(x), 2)
    for step in range(STEPS - 1):  # the adapter's check pushed one
        idx = mine[rng.integers(0, len(mine), 64)]
        ps.pull()
        loss = F.cross_entropy(model(torch.from_numpy(x[idx])), torch.from_numpy(y[idx]))
        ps.zero_grad()
        loss.backward()
        ps.push(batch_size=64)
    say(f"the Python worker pushed {STEPS} steps (loss {loss.item():.3f})")
    return w, model


def flat_job_from_module():
    torch.manual_seed(3)
    model = example.cnn()
    job = pst.flat_job(model, "py-flat-cnn", batch_size=64)
    check(job["model"]["params"] == 421642 and job["model"]["tensors"][0]["name"] == "0.weight",
          job["model"]["tensors"][0])
    check(job["model"]["tensors"][0]["init"].get("uniform", 0) > 0.3, job["model"]["tensors"][0])
    with LocalCluster(job, servers=2) as c:
        w = psclient.connect(c.servers, insecure=True)
        ps = pst.PSModule(example.cnn(), w)
        ps.pull()
        conv = w.view("0.weight")
        bound = 1 / 3  # PyTorch's default for a 1x3x3 fan-in
        check(abs(np.abs(conv).max() - bound) < 0.03, f"conv1 init like PyTorch's: {conv.max()}")
        check(ps.placement[4] == ("7.weight", w.tensors["7.weight"]), ps.placement[4])
        w.close()
    say("a flat job from the module: named tensors, PyTorch-like init, placed by name")


def main():
    job = json.load(open(os.path.join(ROOT, "deploy", "jobs", "fashion_mnist_cnn.json")))
    job.update(job_id="py-mixed", eval_interval_s=0)
    with LocalCluster(job, servers=2) as c:
        out = c.out
        saved = os.path.join(out, "final.bin")
        log = open(os.path.join(out, "c-worker.log"), "w")
        cw = subprocess.Popen([find_program("ps-worker"), "--insecure", "--ps", c.servers,
                               "--index", "0", "--num-workers", "2", "--max-steps", str(STEPS),
                               "--threads", "1", "--eval-interval", "0", "--save-params", saved],
                              stdout=log, stderr=subprocess.STDOUT)
        w, model = python_worker(c, out)
        rc = cw.wait(timeout=180)
        text = open(os.path.join(out, "c-worker.log")).read()
        check(rc == 0, f"ps-worker exit {rc}: {text[-2000:]}")
        m = re.search(r"final test accuracy ([0-9.]+) \(test loss ([0-9.]+)", text)
        check(m is not None, text[-1000:])
        c_acc, c_loss = float(m.group(1)), float(m.group(2))
        versions = [s["version"] for s in c.status()]
        check(versions == [2 * STEPS, 2 * STEPS], f"both workers' pushes applied: {versions}")
        final = np.fromfile(saved, dtype=np.float32)
        check(final.size == w.param_count, final.size)
        w.params[:] = final  # the module's parameters are views of it
        tx, ty = fmnist.load("test")
        acc, loss = example.evaluate(model, tx, ty)
        say(f"ps-worker: test accuracy {c_acc:.4f} (loss {c_loss:.4f}); the same parameters in "
            f"PyTorch: {acc:.4f} (loss {loss:.4f})")
        check(abs(acc - c_acc) <= 0.0011 and abs(loss - c_loss) <= 0.0011,
              "the same model in both")
        check(acc >= 0.70, f"trained: {acc}")
        w.close()
    flat_job_from_module()
    say("python.mixed: every check passed")


if __name__ == "__main__":
    main()
