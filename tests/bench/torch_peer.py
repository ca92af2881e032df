#!/usr/bin/env python3
"""PyTorch's side of tests/bench/gpu_peers.sh: one of our job files' model
trained by PyTorch, as ps-worker --local trains it, for examples/s.

    torch_peer.py --job deploy/jobs/fashion_mnist_cnn.json --mode eager \
        [--device cuda] [--steps 300] [--warmup 30] [--data-dir DIR]
    torch_peer.py --job JOB --count-params

The model is built from the job's "model" section with the rules of
common/model_spec.c (the same shapes, "inputs" graph and initial value
ranges), trained with the job's optimizer and batch size on Fashion-MNIST
read from its IDX files. The whole training set is copied to the device
once and every batch is sliced there, so what is timed is the training
step alone. TF32 is off, as ours trains at fp32 by default.

Prints one JSON line: job, mode, device, batch, steps, examples_per_s,
params, torch, gpu (and a few more keys). --count-params prints the
parameter count only: trainable parameters plus batchnorm's running mean
and variance, which is how our flat layout counts P.

Exit status: 0 done; 2 the job has something this cannot translate (the
message names it); 3 --mode compile failed (the JSON line says why, with
examples_per_s null: not run, not a crash); 1 anything else.

torch is imported inside main() only, so that `python3 -m py_compile`
and --help work where it is not installed."""
import argparse
import array
import gzip
import json
import math
import os
import struct
import sys
import time
import warnings

EXIT_UNSUPPORTED = 2
EXIT_NOT_RUN = 3

# Layer types of common/model_spec.c and the keys each takes (its kinds[]).
KEYS = {
    "conv2d": {"filters", "kernel", "stride", "padding", "bias"},
    "maxpool": {"size", "stride"},
    "avgpool": {"size", "stride"},
    "global_avgpool": set(),
    "dense": {"units", "bias"},
    "relu": set(),
    "dropout": {"rate"},
    "flatten": set(),
    "batchnorm": {"momentum", "epsilon"},
    "add": set(),
    "concat": set(),
    "softmax_xent": set(),
}
# Ours has these too; none has a PyTorch twin here (embeddings read the
# servers' tables and ids that Fashion-MNIST does not have).
UNTRANSLATED = {"embedding", "fm", "sigmoid_xent"}


class Unsupported(Exception):
    """Something in the job that this peer cannot mirror (exit 2)."""


class Layer:
    """One layer of the spec with what model_spec.c derives for it."""

    def __init__(self, index, obj, name, inputs):
        self.index, self.obj, self.type, self.name, self.inputs = (
            index, obj, obj["type"], name, inputs)
        self.in_shape = self.out_shape = None  # (c, h, w) per example
        self.flat_out = False  # the tensor is [N, F] rather than [N, C, H, W]
        self.param_count = 0   # as model_spec.c places it in P


def layer_names(layers):
    """Each layer's name as model_spec.c gives it: its "name", or
    "<type>_<k>" for the k-th layer of that type (named ones counted)."""
    names, seen = [], {}
    for obj in layers:
        t = obj.get("type")
        k = seen.get(t, 0)
        seen[t] = k + 1
        names.append(obj["name"] if "name" in obj else f"{t}_{k}")
    return names


def parse_model(model):
    """The job's model section as a list of Layer with shapes, the way
    common/model_spec.c infers them. Raises Unsupported naming the layer."""
    if not isinstance(model, dict) or "layers" not in model:
        raise Unsupported("the model is not a layer list (a {\"keras\": FILE} model needs "
                          "ps-import-keras first)")
    c, h, w = model["input"]
    classes = model["classes"]
    objs = model["layers"]
    names = layer_names(objs)
    out = []
    for i, obj in enumerate(objs):
        t = obj.get("type")
        where = f"layer {i} ({t} '{names[i]}')"
        if t in UNTRANSLATED:
            raise Unsupported(f"{where}: {t} has no PyTorch translation here")
        if t not in KEYS:
            raise Unsupported(f"{where}: unknown layer type '{t}'")
        extra = set(obj) - KEYS[t] - {"type", "name", "inputs"}
        if extra:
            raise Unsupported(f"{where}: unknown field(s) {sorted(extra)}")
        if "inputs" in obj:
            idx = []
            for n in obj["inputs"]:
                if n == "input":
                    idx.append(-1)
                elif n in names[:i]:
                    idx.append(names.index(n))
                else:
                    raise Unsupported(f"{where}: 'inputs' names '{n}', no earlier layer")
        else:
            idx = [i - 1]
        L = Layer(i, obj, names[i], idx)
        shape = lambda j: (c, h, w) if j < 0 else out[j].out_shape  # noqa: E731
        flat = lambda j: False if j < 0 else out[j].flat_out  # noqa: E731
        ic, ih, iw = L.in_shape = shape(idx[0])
        L.flat_out = flat(idx[0])
        if t == "conv2d":
            k, s = obj["kernel"], obj.get("stride", 1)
            # Ours pads k/2 on every side for "same" (odd k only) and
            # nothing otherwise: "valid" is the default.
            pad = k // 2 if obj.get("padding") == "same" else 0
            L.pad = pad
            L.out_shape = (obj["filters"], (ih + 2 * pad - k) // s + 1, (iw + 2 * pad - k) // s + 1)
            L.flat_out = False
            bias = obj["filters"] if obj.get("bias", True) else 0
            L.param_count = obj["filters"] * ic * k * k + bias
        elif t in ("maxpool", "avgpool"):
            size = obj["size"]
            stride = obj.get("stride", size)
            L.out_shape = (ic, (ih - size) // stride + 1, (iw - size) // stride + 1)
            L.flat_out = False
        elif t == "global_avgpool":
            L.out_shape = (ic, 1, 1)
            L.flat_out = False
        elif t == "dense":
            L.out_shape = (obj["units"], 1, 1)
            L.flat_out = True
            bias = obj["units"] if obj.get("bias", True) else 0
            L.param_count = obj["units"] * ic * ih * iw + bias
        elif t == "flatten":
            L.out_shape = (ic * ih * iw, 1, 1)
            L.flat_out = True
        elif t == "concat":
            L.out_shape = (sum(math.prod(shape(j)) for j in idx), 1, 1)
            L.flat_out = True
        elif t == "batchnorm":
            # gamma, beta, moving mean, moving variance: 4 per channel.
            L.out_shape = L.in_shape
            L.param_count = 4 * ic
        else:  # relu, dropout, add, softmax_xent
            L.out_shape = L.in_shape
        if t == "softmax_xent":
            if i != len(objs) - 1:
                raise Unsupported(f"{where}: must be the last layer")
            if math.prod(L.in_shape) != classes:
                raise Unsupported(f"{where}: {math.prod(L.in_shape)} logits for {classes} classes")
        out.append(L)
    if model.get("ids"):
        raise Unsupported("the model reads categorical ids (\"ids\"), which Fashion-MNIST has not")
    if not out or out[-1].type != "softmax_xent":
        raise Unsupported("the model does not end in softmax_xent")
    return out


def init_limit(layers, i):
    """model_spec.c's init_limit: He-uniform when a relu follows in the
    list (directly or after a batchnorm), Glorot-uniform otherwise."""
    L = layers[i]
    ic, ih, iw = L.in_shape
    if L.type == "conv2d":
        kk = L.obj["kernel"] ** 2
        fan_in, fan_out = ic * kk, L.obj["filters"] * kk
    else:
        fan_in, fan_out = ic * ih * iw, L.obj["units"]
    nxt = i + 1
    if nxt < len(layers) and layers[nxt].type == "batchnorm":
        nxt += 1
    relu_next = nxt < len(layers) and layers[nxt].type == "relu"
    return math.sqrt(6.0 / fan_in) if relu_next else math.sqrt(6.0 / (fan_in + fan_out))


def build_module(torch, layers):
    """A torch.nn.Module computing the logits of the spec's graph."""
    nn = torch.nn

    class SpecNet(nn.Module):
        def __init__(self):
            super().__init__()
            mods = []
            self.kinds, self.srcs, self.shapes = [], [], []
            for i, L in enumerate(layers):
                o, t = L.obj, L.type
                m = None
                if t == "conv2d":
                    k = o["kernel"]
                    m = nn.Conv2d(L.in_shape[0], o["filters"], k, stride=o.get("stride", 1),
                                  padding=L.pad, bias=o.get("bias", True))
                elif t == "maxpool":
                    m = nn.MaxPool2d(o["size"], o.get("stride", o["size"]))
                elif t == "avgpool":
                    m = nn.AvgPool2d(o["size"], o.get("stride", o["size"]))
                elif t == "global_avgpool":
                    m = nn.AdaptiveAvgPool2d(1)
                elif t == "dense":
                    m = nn.Linear(math.prod(L.in_shape), o["units"], bias=o.get("bias", True))
                elif t == "relu":
                    m = nn.ReLU()
                elif t == "dropout":
                    m = nn.Dropout(o["rate"])
                elif t == "batchnorm":
                    # Ours (Keras's rule): moving = momentum*moving +
                    # (1-momentum)*batch. PyTorch's momentum is the new
                    # batch's weight: running = (1-m)*running + m*batch. So
                    # PyTorch's m is 1 - ours; the defaults are Keras's
                    # (0.99 and 1e-3), not PyTorch's (0.1 and 1e-5).
                    momentum = 1.0 - o.get("momentum", 0.99)
                    eps = o.get("epsilon", 1e-3)
                    bn = nn.BatchNorm1d if L.flat_out else nn.BatchNorm2d
                    m = bn(L.in_shape[0], eps=eps, momentum=momentum)
                if m is not None and t in ("conv2d", "dense"):
                    # Ours: uniform in +-limit, biases zero. The draws differ
                    # (ours hashes the parameter's index), the distribution
                    # does not.
                    limit = init_limit(layers, i)
                    with torch.no_grad():
                        m.weight.uniform_(-limit, limit)
                        if m.bias is not None:
                            m.bias.zero_()
                mods.append(m if m is not None else nn.Identity())
                self.kinds.append(t)
                self.srcs.append(tuple(L.inputs))
                self.shapes.append(L.in_shape)
            self.layers = nn.ModuleList(mods)

        def forward(self, x):
            # Every output is kept, since a later layer may read any earlier
            # one; autograd holds most of them for the backward pass anyway.
            outs = []
            n = x.shape[0]
            for i, m in enumerate(self.layers):
                t, src = self.kinds[i], self.srcs[i]
                a = x if src[0] < 0 else outs[src[0]]
                if t in ("conv2d", "maxpool", "avgpool", "global_avgpool") and a.dim() != 4:
                    a = a.reshape(n, *self.shapes[i])  # a flat input read as [C, H, W]
                if t in ("dense", "flatten"):
                    a = a.flatten(1)
                if t == "add":
                    y = a
                    for j in src[1:]:
                        y = y + (x if j < 0 else outs[j]).reshape(a.shape)
                elif t == "concat":
                    y = torch.cat([(x if j < 0 else outs[j]).flatten(1) for j in src], 1)
                elif t == "softmax_xent":
                    y = a.flatten(1)  # the logits; the loss is taken outside
                else:
                    y = m(a)
                outs.append(y)
            return outs[-1]

    return SpecNet()


def count_params(model):
    """Trainable parameters plus batchnorm's running mean and variance (not
    num_batches_tracked): model_spec.c's P."""
    n = sum(p.numel() for p in model.parameters())
    n += sum(b.numel() for name, b in model.named_buffers()
             if name.endswith("running_mean") or name.endswith("running_var"))
    return n


def open_idx(data_dir, base):
    """The file plain if present, else .gz, as worker/data/data.c does."""
    plain = os.path.join(data_dir, base)
    if os.path.exists(plain):
        return open(plain, "rb")
    gz = plain + ".gz"
    if os.path.exists(gz):
        return gzip.open(gz, "rb")
    raise FileNotFoundError(f"neither {plain} nor {gz} exists")


def read_idx(data_dir, base, magic):
    with open_idx(data_dir, base) as f:
        raw = f.read()
    got, = struct.unpack(">I", raw[:4])
    if got != magic:
        raise ValueError(f"{base}: magic {got:#x}, expected {magic:#x}")
    ndims = magic & 0xff
    dims = struct.unpack(">" + "I" * ndims, raw[4:4 + 4 * ndims])
    body = raw[4 + 4 * ndims:]
    if len(body) != math.prod(dims):
        raise ValueError(f"{base}: {len(body)} data bytes for dims {dims}")
    return dims, body


def load_train(torch, data_dir, device):
    """Fashion-MNIST's training split on the device: images [N, 1, H, W]
    float32 as byte/255 (data.c's table: the single-precision quotient,
    which v/255.0 in double rounded to float32 equals, since v/255's binary
    digits repeat every 8 bits and never sit at a rounding tie), labels
    int64."""
    dims, pix = read_idx(data_dir, "train-images-idx3-ubyte", 0x803)
    ldims, lab = read_idx(data_dir, "train-labels-idx1-ubyte", 0x801)
    n, h, w = dims
    if ldims[0] != n:
        raise ValueError(f"{n} images but {ldims[0]} labels")
    table = torch.frombuffer(array.array("f", [v / 255.0 for v in range(256)]),
                             dtype=torch.float32).to(device)
    u8 = torch.frombuffer(bytearray(pix), dtype=torch.uint8).to(device)
    x = table[u8.long()].view(n, 1, h, w)
    del u8
    y = torch.frombuffer(bytearray(lab), dtype=torch.uint8).to(device).long()
    return x, y


def make_optimizer(torch, job, params):
    """The job's optimizer with common/job.c's defaults; each rule is
    PyTorch's with these settings (common/optim.h states ours)."""
    o = {"name": "adam", "lr": 0.001, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
         "momentum": 0.9, "nesterov": False, "initial_accumulator": 0.1}
    o.update(job.get("optimizer", {}))
    name = o["name"]
    if name == "adam":
        return torch.optim.Adam(params, lr=o["lr"], betas=(o["beta1"], o["beta2"]), eps=o["eps"])
    if name == "sgd":
        return torch.optim.SGD(params, lr=o["lr"])
    if name == "momentum":
        # v = mu*v + g; p -= lr*v (nesterov: p -= lr*(g + mu*v)): PyTorch's
        # SGD with dampening 0.
        return torch.optim.SGD(params, lr=o["lr"], momentum=o["momentum"],
                               nesterov=bool(o["nesterov"]))
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=o["lr"], eps=o["eps"],
                                   initial_accumulator_value=o["initial_accumulator"])
    raise Unsupported(f"optimizer '{name}' has no PyTorch translation here")


def job_data(job, args):
    ds = job.get("dataset", {})
    name = ds.get("name", "fashion-mnist")
    if name not in ("fashion-mnist", "mnist"):
        raise Unsupported(f"data set '{name}' (only fashion-mnist and mnist are read here)")
    for k in ("mean", "std", "crop_pad", "flip"):
        if k in ds:
            raise Unsupported(f"dataset.{k}: normalisation and augmentation are not mirrored here")
    return args.data_dir or ds.get("dir") or "/usr/share/datasets/fashion-mnist"


def emit(rec):
    print(json.dumps(rec), flush=True)


def not_run(rec, stem, e):
    """--mode compile failed: the reason on stderr and in the JSON line,
    with examples_per_s null; exit 3 says "not run" rather than a crash."""
    rec["error"] = f"torch.compile: {type(e).__name__}: {e}"[:500]
    print(f"torch_peer: {stem}: torch.compile failed, not run: {rec['error']}", file=sys.stderr)
    emit(rec)
    return EXIT_NOT_RUN


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--job", required=True, help="a job file (deploy/jobs/*.json)")
    ap.add_argument("--mode", choices=("eager", "compile"), default="eager")
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    ap.add_argument("--steps", type=int, default=300, help="timed steps")
    ap.add_argument("--warmup", type=int, default=30, help="untimed steps before them")
    ap.add_argument("--data-dir", help="the IDX files (default: the job's dataset.dir)")
    ap.add_argument("--compile-mode", default="default",
                    help="torch.compile's mode: default, reduce-overhead (CUDA graphs), "
                    "max-autotune")
    ap.add_argument("--cudnn-benchmark", action="store_true",
                    help="let cuDNN time its algorithms (off: its heuristics pick, as ours)")
    ap.add_argument("--count-params", action="store_true",
                    help="print the parameter count (with batchnorm's running statistics) only")
    args = ap.parse_args()

    with open(args.job) as f:
        job = json.load(f)
    stem = os.path.splitext(os.path.basename(args.job))[0]
    try:
        layers = parse_model(job.get("model"))
        if not args.count_params:
            data_dir = job_data(job, args)
    except Unsupported as e:
        print(f"torch_peer: {stem}: cannot translate: {e}", file=sys.stderr)
        return EXIT_UNSUPPORTED

    warnings.filterwarnings("ignore", message=".*Failed to initialize NumPy.*")
    import torch
    import torch.nn.functional as F

    torch.manual_seed(job.get("seed", 1))
    if args.count_params:
        got = count_params(build_module(torch, layers))
        want = sum(L.param_count for L in layers)
        if got != want:  # the translation lost or added a tensor somewhere
            print(f"torch_peer: {stem}: the module holds {got} values, model_spec.c's rules "
                  f"give {want}", file=sys.stderr)
        print(got)
        return 0

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        # fp32 throughout, as ours at its default --precision fp32.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.benchmark = args.cudnn_benchmark
    batch = int(job.get("batch_size", 64))
    model = build_module(torch, layers).to(device)
    model.train()
    try:
        opt = make_optimizer(torch, job, model.parameters())
    except Unsupported as e:
        print(f"torch_peer: {stem}: cannot translate: {e}", file=sys.stderr)
        return EXIT_UNSUPPORTED
    x_all, y_all = load_train(torch, data_dir, device)
    if tuple(x_all.shape[1:]) != tuple(job["model"]["input"]):
        print(f"torch_peer: {stem}: the data's examples are {tuple(x_all.shape[1:])}, the model "
              f"reads {tuple(job['model']['input'])}", file=sys.stderr)
        return EXIT_UNSUPPORTED
    n = x_all.shape[0]
    per_epoch = n // batch  # whole batches only: one shape, so compile builds one graph

    rec = {"job": stem, "mode": args.mode, "device": str(device), "batch": batch,
           "steps": args.steps, "warmup": args.warmup, "examples_per_s": None,
           "params": count_params(model), "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name(device) if cuda else None,
           "tf32": bool(torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32)
           if cuda else False,
           "cudnn_benchmark": args.cudnn_benchmark,
           "optimizer": type(opt).__name__}
    if args.mode == "compile":
        rec["compile_mode"] = args.compile_mode

    net = model
    if args.mode == "compile":
        try:
            net = torch.compile(model, mode=args.compile_mode)
        except Exception as e:  # noqa: BLE001 - any failure means "not run"
            return not_run(rec, stem, e)

    gen = torch.Generator(device=device)
    gen.manual_seed(job.get("seed", 1))
    state = {"perm": None, "pos": per_epoch}

    def next_batch():
        # A fresh permutation each epoch, drawn and applied on the device.
        if state["pos"] == per_epoch:
            state["perm"] = torch.randperm(n, generator=gen, device=device)
            state["pos"] = 0
        idx = state["perm"][state["pos"] * batch:(state["pos"] + 1) * batch]
        state["pos"] += 1
        return x_all.index_select(0, idx), y_all.index_select(0, idx)

    def step():
        xb, yb = next_batch()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(xb), yb)
        loss.backward()
        opt.step()
        return loss

    def run(k):
        loss = None
        for _ in range(k):
            loss = step()
        if cuda:
            torch.cuda.synchronize(device)
        return loss

    try:
        t_first = time.perf_counter()
        loss = run(args.warmup)
        t0 = time.perf_counter()
        loss = run(args.steps) if args.steps else loss
        t1 = time.perf_counter()
    except Exception as e:  # noqa: BLE001
        if args.mode != "compile":
            raise
        # Compilation happens on the first calls (in the warm-up, unless
        # there is none): its failure is reported as the mode not run.
        return not_run(rec, stem, e)
    rec["warmup_s"] = round(t0 - t_first, 3)
    rec["seconds"] = round(t1 - t0, 4)
    rec["examples_per_s"] = round(args.steps * batch / (t1 - t0), 1) if args.steps else None
    rec["loss"] = round(float(loss.detach()), 4) if loss is not None else None
    emit(rec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
