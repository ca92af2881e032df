"""Keras models beside their imports (integration.keras_import).

  keras_compare.py make DIR
      writes DIR/<name>.json (model.to_json()), DIR/<name>.npz
      (np.savez of model.get_weights(), biases made non-zero) for each model
  keras_compare.py compare MODEL.json WEIGHTS.npz OURS_DIR [--keras3]
      runs the Keras model with those weights on OURS_DIR/input.npy (N, C, H,
      W, as onnx_check wrote it with ps's forward pass) and compares its
      class probabilities with OURS_DIR/probs.npy: max |p_keras - p_ours|
      <= 1e-4 and the same arg-max for >= 99.9% of the examples.

The models: "seq" (tf_keras Sequential, a non-square 12x10x3 input, a
Flatten of a spatial tensor into a Dense layer, so the column order of
that Dense layer's kernel matters) and "chain" (Keras 3 functional: a
stride-2 valid convolution, ReLU and Activation layers, average and global
average pooling, a logits output) and "res" (Keras 3 functional: a
residual block, an Add of a branch and its shortcut, then a Flatten of a
non-square tensor into a Dense layer).
"""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
import numpy as np  # noqa: E402


def keras_module(k3):
    if k3:
        import keras
        return keras
    import tf_keras
    return tf_keras


def build(name):
    if name == "seq":
        k = keras_module(False)
        L = k.layers
        return k.Sequential([
            L.InputLayer(input_shape=(12, 10, 3)),
            L.Conv2D(6, 3, padding="same", activation="relu"),
            L.MaxPooling2D(2),
            L.Conv2D(8, 3, padding="valid"),
            L.Activation("relu"),
            L.Flatten(),
            L.Dense(16, activation="relu"),
            L.Dropout(0.5),
            L.Dense(5, activation="softmax"),
        ])
    k = keras_module(True)
    L = k.layers
    if name == "res":
        x = inp = k.Input(shape=(10, 12, 3))
        s = L.Conv2D(8, 3, padding="same", activation="relu")(x)
        y = L.Conv2D(8, 3, padding="same")(s)
        y = L.ReLU()(y)
        y = L.Conv2D(8, 3, padding="same")(y)
        x = L.Add()([s, y])
        x = L.ReLU()(x)
        x = L.MaxPooling2D(2)(x)
        x = L.Flatten()(x)
        x = L.Dense(6, activation="softmax")(x)
        return k.Model(inp, x)
    x = inp = k.Input(shape=(16, 16, 2))
    x = L.Conv2D(8, 3, strides=2, padding="valid")(x)
    x = L.ReLU()(x)
    x = L.Conv2D(12, 3, padding="same", activation="relu")(x)
    x = L.AveragePooling2D(2)(x)
    x = L.GlobalAveragePooling2D()(x)
    x = L.Dense(4)(x)
    return k.Model(inp, x)


def make(out):
    rng = np.random.default_rng(11)
    for name in ("seq", "chain", "res"):
        m = build(name)
        w = [a + rng.normal(0, 0.1, a.shape).astype(np.float32) if a.ndim == 1 else a
             for a in m.get_weights()]
        with open(os.path.join(out, name + ".json"), "w") as f:
            f.write(m.to_json())
        np.savez(os.path.join(out, name + ".npz"), *w)
        print(f"keras_compare: {name}: {len(w)} weight arrays, {m.count_params()} parameters")


def compare(model_json, weights, ours, k3):
    k = keras_module(k3)
    with open(model_json) as f:
        m = k.models.model_from_json(f.read())
    z = np.load(weights)
    m.set_weights([z[f"arr_{i}"] for i in range(len(z.files))])
    x = np.load(os.path.join(ours, "input.npy"))
    p_ours = np.load(os.path.join(ours, "probs.npy"))
    out = m.predict(np.transpose(x, (0, 2, 3, 1)), verbose=0, batch_size=256)
    act = m.layers[-1].get_config().get("activation")
    if act != "softmax":  # logits
        e = np.exp(out - out.max(axis=1, keepdims=True))
        out = e / e.sum(axis=1, keepdims=True)
    diff = float(np.abs(out - p_ours).max())
    agree = float((out.argmax(1) == p_ours.argmax(1)).mean())
    ok = diff <= 1e-4 and agree >= 0.999
    print(f"keras_compare: {len(x)} examples: max |p_keras - p_ours| = {diff:.3g} (limit 1e-4), "
          f"arg-max agrees for {100 * agree:.2f}% (at least 99.9%)")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "make":
        make(sys.argv[2])
        sys.exit(0)
    if len(sys.argv) in (5, 6) and sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2], sys.argv[3], sys.argv[4], "--keras3" in sys.argv[5:]))
    sys.exit(__doc__)
