#!/usr/bin/env bash
# A Keras user's first hour, end to end: a tf_keras CNN and a data set of
# one's own as NumPy arrays go in; a model trained by a local cluster comes
# out as an ONNX file that onnxruntime runs.
#
#   deploy/keras_flow.sh [BUILD_DIR]     (default: build)
#
# 1. Python (tensorflow-cpu, tf_keras, onnxruntime and numpy, in a venv at
#    BUILD_DIR/venv-flow, from PyPI) writes the model (model.to_json()) and
#    the data: Fashion-MNIST from the dataset-fashion-mnist package, saved
#    as train.npz and test.npz (uint8 images N x 28 x 28 x 1, as NumPy users
#    hold them, and integer labels) to stand for one's own.
# 2. ps-import-keras turns the model into the job's "model"; the job reads
#    the .npz files ("dataset": {"name": "npz", ...}, NHWC).
# 3. deploy/local-cluster.sh trains it: 2 servers, 2 workers, checkpoints.
# 4. ps-export --format onnx writes the model; onnxruntime classifies the
#    test split with it and reports its accuracy beside ps-worker's.
# Everything goes to runs/keras_flow/.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
out=runs/keras_flow
venv=$build/venv-flow
for p in ps-server ps-worker ps-export ps-import-keras; do
  [ -x "$build/$p" ] || { echo "keras_flow: no $build/$p: build first (cmake -S . -B $build && cmake --build $build)" >&2; exit 2; }
done
[ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] \
  || { echo "keras_flow: dataset-fashion-mnist is not installed (deploy/install-deps.sh)" >&2; exit 2; }
if ! "$venv/bin/python" -c "import numpy, tf_keras, onnxruntime" 2>/dev/null; then
  echo "keras_flow: installing tensorflow-cpu, tf_keras, onnxruntime and numpy into $venv"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check tensorflow-cpu==2.18.1 \
    tf_keras==2.18.0 onnxruntime numpy
fi
rm -rf "$out"
mkdir -p "$out"

# 1. The model and the data, as a Keras user has them.
CUDA_VISIBLE_DEVICES=-1 TF_CPP_MIN_LOG_LEVEL=3 "$venv/bin/python" - "$out" <<'PY'
import gzip, sys
import numpy as np
import tf_keras as k

out = sys.argv[1]
L = k.layers
model = k.Sequential([
    L.InputLayer(input_shape=(28, 28, 1)),
    L.Conv2D(32, 3, padding="same", activation="relu"),
    L.MaxPooling2D(2),
    L.Conv2D(64, 3, padding="same", use_bias=False),
    L.BatchNormalization(),
    L.Activation("relu"),
    L.AveragePooling2D(2),
    L.Flatten(),
    L.Dense(128, activation="relu"),
    L.Dropout(0.25),
    L.Dense(10, activation="softmax"),
])
open(f"{out}/model.json", "w").write(model.to_json())

def idx(name):
    with gzip.open(f"/usr/share/datasets/fashion-mnist/{name}.gz") as f:
        b = f.read()
    dims = b[3]  # IDX: magic 0 0 type dims, then the sizes, big-endian
    shape = [int.from_bytes(b[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(b, np.uint8, offset=4 + 4 * dims).reshape(shape)

for split, prefix in (("train", "train"), ("test", "t10k")):
    x = idx(f"{prefix}-images-idx3-ubyte")[..., None]  # N x 28 x 28 x 1, uint8
    y = idx(f"{prefix}-labels-idx1-ubyte").astype(np.int64)
    np.savez_compressed(f"{out}/{split}.npz", x=x, y=y)
    print(f"keras_flow: {split}.npz: x {x.shape} {x.dtype}, y {y.shape} {y.dtype}")
PY

# 2. The job: the imported model, the .npz data.
"$build/ps-import-keras" --model "$out/model.json" --out "$out/spec.json"
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
job = {
    "job_id": "keras-flow",
    "model": json.load(open(f"{out}/spec.json")),
    "optimizer": {"name": "adam", "lr": 0.001},
    "seed": 1, "batch_size": 64, "epochs": 2, "mode": "async",
    "dataset": {"name": "npz", "dir": out, "train": "train.npz", "test": "test.npz",
                "layout": "nhwc"},
    "eval_interval_s": 0,
}
json.dump(job, open(f"{out}/job.json", "w"), indent=1)
PY

# 3. Training in a local cluster, with checkpoints.
deploy/local-cluster.sh --job "$out/job.json" --bin "$build" --servers 2 --workers 2 \
  --out "$out/run" --checkpoint-dir "$out/ckpt" -- --log-interval 100

# 4. ONNX out, run in onnxruntime on the test split.
"$build/ps-export" --job "$out/job.json" --checkpoints "$out/ckpt" --format onnx --out "$out/model.onnx"
"$venv/bin/python" - "$out" <<'PY'
import sys
import numpy as np
import onnxruntime as ort
out = sys.argv[1]
t = np.load(f"{out}/test.npz")
x = t["x"].transpose(0, 3, 1, 2).astype(np.float32) / 255.0  # as the workers see it: NCHW in [0, 1]
s = ort.InferenceSession(f"{out}/model.onnx", providers=["CPUExecutionProvider"])
p = s.run(["probabilities"], {"input": x})[0]
print(f"keras_flow: onnxruntime: test accuracy {(p.argmax(1) == t['y']).mean():.4f} "
      f"on {len(x)} examples of test.npz")
PY
grep -h "^final test accuracy" "$out/run/worker-0.log" | sed 's/^/keras_flow: ps-worker: /'
