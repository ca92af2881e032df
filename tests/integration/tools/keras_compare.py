"""Keras models beside their imports (integration.keras_import).

  keras_compare.py make DIR
      writes DIR/<name>.json (model.to_json()), DIR/<name>.npz
      (np.savez of model.get_weights(), biases made non-zero; batch
      normalization's gamma and beta drawn, its moving mean and variance
      measured on [0, 1) images like the synthetic set's, then perturbed)
      for each model
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
non-square tensor into a Dense layer) and, with batch normalization,
"bn" (tf_keras Sequential: a bias-less Conv2D, BatchNormalization and
ReLU; a Flatten of a non-square tensor into BatchNormalization, so its
per-feature arrays are reordered like a Dense kernel's rows; a bias-less
Dense layer and BatchNormalization with epsilon 1e-5) and "resbn" (Keras 3
functional: a residual block with BatchNormalization on the branch and on
a 1x1 projection shortcut, a Dense layer and BatchNormalization after
global pooling, logits).
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
    if name == "bn":
        k = keras_module(False)
        L = k.layers
        return k.Sequential([
            L.InputLayer(input_shape=(10, 8, 3)),
            L.Conv2D(6, 3, padding="same", use_bias=False),
            L.BatchNormalization(),
            L.ReLU(),
            L.MaxPooling2D(2),
            L.Flatten(),
            L.BatchNormalization(momentum=0.9),
            L.Dense(12, use_bias=False),
            L.BatchNormalization(epsilon=1e-5),
            L.Activation("relu"),
            L.Dense(5, activation="softmax"),
        ])
    k = keras_module(True)
    L = k.layers
    if name == "resbn":
        x = inp = k.Input(shape=(12, 10, 3))
        x = L.Conv2D(8, 3, padding="same", use_bias=False)(x)
        x = L.BatchNormalization()(x)
        s = L.ReLU()(x)
        y = L.Conv2D(12, 3, padding="same", use_bias=False)(s)
        y = L.BatchNormalization()(y)
        y = L.ReLU()(y)
        y = L.Conv2D(12, 3, padding="same", use_bias=False)(y)
        y = L.BatchNormalization(epsilon=1e-4)(y)
        s = L.Conv2D(12, 1, use_bias=False)(s)
        s = L.BatchNormalization()(s)
        x = L.Add()([s, y])
        x = L.ReLU()(x)
        x = L.GlobalAveragePooling2D()(x)
        x = L.Dense(16)(x)
        x = L.BatchNormalization()(x)
        x = L.ReLU()(x)
        x = L.Dense(4)(x)
        return k.Model(inp, x)
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


def set_batchnorm(k, m, rng):
    """Gives each BatchNormalization of m, in order, gamma and beta away
    from 1 and 0 and moving statistics near those of its input on [0, 1)
    images (mean shifted, variance scaled, so that none is the batch's
    own), so that the comparison checks the normalization's arithmetic."""
    x = None
    for layer in m.layers:
        if type(layer).__name__ != "BatchNormalization":
            continue
        if x is None:  # drawn only here: the other models' weights stay as they were
            x = rng.uniform(0, 1, (256,) + tuple(m.input_shape[1:])).astype(np.float32)
        a = k.Model(m.inputs, layer.input).predict(x, verbose=0, batch_size=256)
        axes = tuple(range(a.ndim - 1))
        mean, var = a.mean(axis=axes), a.var(axis=axes)
        c = mean.shape[0]
        gamma = rng.uniform(0.5, 1.5, c)
        beta = rng.normal(0, 0.3, c)
        mean = mean + rng.normal(0, 0.2, c) * np.sqrt(var)
        var = var * rng.uniform(0.6, 1.6, c)
        layer.set_weights([v.astype(np.float32) for v in (gamma, beta, mean, var)])


def make(out):
    rng = np.random.default_rng(11)
    for name in ("seq", "chain", "res", "bn", "resbn"):
        m = build(name)
        k = keras_module(name not in ("seq", "bn"))
        # Biases first (they move the statistics), then batch normalization.
        m.set_weights([a + rng.normal(0, 0.1, a.shape).astype(np.float32) if a.ndim == 1 else a
                       for a in m.get_weights()])
        set_batchnorm(k, m, rng)
        w = m.get_weights()
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
