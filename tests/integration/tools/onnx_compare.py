#!/usr/bin/env python3
"""Runs a model written by `ps-export --format onnx` in onnxruntime and
compares its probabilities with ps-worker's own (onnx_check's .npy files).

  onnx_compare.py MODEL.onnx DIR [--classes K] [--input C,H,W]

DIR holds input.npy (N, C, H, W), labels.npy (N) and probs.npy (N, K) from
onnx_check. Checks, in order:
  - onnx.checker.check_model (full_check: with shape inference) accepts it;
  - the file is what the exporter promises: IR version 7, operator set 13
    of the default domain, producer "ps", one input "input" float32
    [N, C, H, W] and one output "probabilities" float32 [N, K] with a
    symbolic batch dimension N, no Dropout node;
  - onnxruntime (CPU) runs it on all N examples, and on a batch of 3, the
    second giving the first's rows;
  - max |p_onnx - p_ours| <= 1e-4, and the arg-max agrees for >= 99.9% of
    the examples.
Prints the figures; exits 1 with the reason when a check fails."""
import argparse
import sys

import numpy as np
import onnx
import onnxruntime as ort

MAX_ABS = 1e-4
MIN_AGREE = 0.999


def fail(msg):
    print("onnx_compare: FAIL: " + msg)
    sys.exit(1)


def dims_of(value_info):
    out = []
    for d in value_info.type.tensor_type.shape.dim:
        out.append(d.dim_param if d.WhichOneof("value") == "dim_param" else d.dim_value)
    return out


def check_file(model, n_classes, chw):
    onnx.checker.check_model(model, full_check=True)
    if model.ir_version != 7:
        fail(f"ir_version {model.ir_version}, expected 7")
    opsets = {o.domain: o.version for o in model.opset_import}
    if opsets != {"": 13}:
        fail(f"operator sets {opsets}, expected only the default domain's 13")
    if model.producer_name != "ps":
        fail(f"producer '{model.producer_name}', expected 'ps'")
    g = model.graph
    if [i.name for i in g.input] != ["input"] or [o.name for o in g.output] != ["probabilities"]:
        fail(f"inputs {[i.name for i in g.input]}, outputs {[o.name for o in g.output]}")
    f32 = onnx.TensorProto.FLOAT
    if g.input[0].type.tensor_type.elem_type != f32 or g.output[0].type.tensor_type.elem_type != f32:
        fail("the input or the output is not float32")
    din, dout = dims_of(g.input[0]), dims_of(g.output[0])
    if len(din) != 4 or not isinstance(din[0], str) or din[0] == "" or (chw and din[1:] != chw):
        fail(f"input shape {din}, expected [N, C, H, W] with a symbolic N")
    if len(dout) != 2 or dout[0] != din[0] or (n_classes and dout[1] != n_classes):
        fail(f"output shape {dout}, expected [{din[0]}, classes]")
    ops = [n.op_type for n in g.node]
    if "Dropout" in ops:
        fail("a Dropout node in the inference graph")
    for t in g.initializer:
        if t.data_type == f32 and (not t.raw_data or t.float_data):
            fail(f"initializer {t.name}: its values are not in raw_data")
    print(f"onnx_compare: onnx.checker accepts it: IR {model.ir_version}, opset 13, "
          f"input {din}, output {dout}, {len(g.initializer)} initializers, "
          f"nodes {' '.join(ops)}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("dir")
    ap.add_argument("--classes", type=int, default=0)
    ap.add_argument("--input", default="")
    a = ap.parse_args()
    chw = [int(v) for v in a.input.split(",")] if a.input else None

    model = onnx.load(a.model)
    check_file(model, a.classes, chw)

    x = np.load(f"{a.dir}/input.npy")
    y = np.load(f"{a.dir}/labels.npy").astype(np.int64)
    ours = np.load(f"{a.dir}/probs.npy")
    sess = ort.InferenceSession(a.model, providers=["CPUExecutionProvider"])
    theirs = sess.run(["probabilities"], {"input": x})[0]
    if theirs.shape != ours.shape or theirs.dtype != np.float32:
        fail(f"onnxruntime gave {theirs.dtype} {theirs.shape}, ours are {ours.shape}")
    few = sess.run(["probabilities"], {"input": x[:3]})[0]
    if not np.allclose(few, theirs[:3], rtol=0, atol=1e-6):
        fail("a batch of 3 does not give the rows of the whole batch")

    n = len(x)
    max_abs = float(np.max(np.abs(theirs - ours)))
    agree = float(np.mean(np.argmax(theirs, 1) == np.argmax(ours, 1)))
    acc_onnx = float(np.mean(np.argmax(theirs, 1) == y))
    acc_ours = float(np.mean(np.argmax(ours, 1) == y))
    print(f"onnx_compare: {n} examples: max |p_onnx - p_ours| = {max_abs:.3g} (limit {MAX_ABS:g}), "
          f"arg-max agrees for {agree * 100:.2f}% (at least {MIN_AGREE * 100:.1f}%); "
          f"accuracy {acc_onnx:.4f} in onnxruntime, {acc_ours:.4f} in ps")
    if not max_abs <= MAX_ABS:
        i = int(np.argmax(np.max(np.abs(theirs - ours), 1)))
        fail(f"probabilities differ by {max_abs:.3g} (example {i}: onnx {theirs[i]}, ours {ours[i]})")
    if agree < MIN_AGREE:
        fail(f"the arg-max agrees for only {agree * 100:.2f}% of the examples")


if __name__ == "__main__":
    main()
