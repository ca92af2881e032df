#!/usr/bin/env bash
# integration.keras_import: Keras models brought over with ps-import-keras
# compute what Keras computes, and train in a cluster from Keras's weights.
#
#   tests/integration/keras_import.sh BUILD_DIR
#
# Real Keras (tensorflow-cpu and tf_keras from PyPI, in a venv kept and
# reused in BUILD_DIR/venv-keras, or $PS_KERAS_VENV) writes five models and
# their weights (tools/keras_compare.py: a tf_keras Sequential CNN on a
# non-square input with a Flatten into a Dense layer, and a Keras 3
# functional chain with a strided convolution, average and global average
# pooling and logits, and a Keras 3 residual block: a branch added to its
# shortcut; with batch normalization, whose moving statistics, gamma and
# beta are set away from their initial values: a tf_keras Sequential CNN
# with bias-less Conv2D and Dense layers, each followed by
# BatchNormalization, and one after a Flatten; a Keras 3 residual block
# with BatchNormalization on the branch and the projection shortcut, and
# after a Dense layer).
# For each: ps-import-keras gives the spec; a job holds it; ps-import-keras
# --weights writes the weights as the job's starting checkpoint; onnx_check
# runs ps's forward pass (batch normalization as at inference) from that
# checkpoint over the job's test split; Keras runs on the same examples
# (predict: inference mode): the class probabilities agree within 1e-4 and
# the arg-max for >= 99.9% of them. For the batch-normalized models
# ps-export also writes the checkpoint as .npy files, which must hold
# Keras's gamma, beta, moving_mean and moving_variance arrays, and as an
# ONNX model, which onnxruntime runs beside onnx_check's probabilities
# when the venv of integration.onnx_export (BUILD_DIR/venv-onnx, or
# $PS_ONNX_VENV) is there (not installed here). Then one ps-server restores
# each of two checkpoints (the CNN's and the batch-normalized CNN's) and a
# worker trains from it. Bad input (a weights file of another model, a job
# whose model differs) is refused with its cause and writes nothing.
# Skipped (77) when pip cannot install the packages.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=$(cd "${1:?usage: keras_import.sh BUILD_DIR}" && pwd)
out=$(mktemp -d /tmp/ps-it-keras.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  [ -n "${PS_KEEP_TEST_OUT:-}" ] || rm -rf "$out"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# PS_KERAS_VENV: another build's venv to reuse (CI's sanitizer pass).
venv=${PS_KERAS_VENV:-$build/venv-keras}
pins="tensorflow-cpu==2.18.1 tf_keras==2.18.0"
probe="import numpy, tensorflow, tf_keras, keras"
if [ "$(cat "$venv/.pins" 2>/dev/null)" != "$pins" ] || ! "$venv/bin/python" -c "$probe" 2>/dev/null; then
  rm -rf "$venv"
  skip() { tail -3 "$out/venv.log"; rm -rf "$venv"; echo "SKIPPED: $1"; exit 77; }
  python3 -m venv "$venv" >"$out/venv.log" 2>&1 || skip "python3 -m venv failed"
  # shellcheck disable=SC2086
  timeout 900 "$venv/bin/pip" install --quiet --disable-pip-version-check --timeout 30 --retries 2 \
    $pins >>"$out/venv.log" 2>&1 || skip "pip cannot install $pins (PyPI unreachable?)"
  "$venv/bin/python" -c "$probe" >>"$out/venv.log" 2>&1 \
    || { tail -3 "$out/venv.log"; fail "$pins installed but do not import"; }
  echo "$pins" >"$venv/.pins"
fi
py=("$venv/bin/python" "$here/tools/keras_compare.py")

timeout 300 "${py[@]}" make "$out" >"$out/make.log" 2>&1 || { cat "$out/make.log"; fail "Keras could not write the models"; }
grep "^keras_compare" "$out/make.log"

# job NAME: a job around NAME's imported spec, on synthetic data of the
# model's input shape.
job() {
  python3 - "$out/$1.spec.json" "$out/$1.job.json" "$1" <<'PY'
import json, sys
spec = json.load(open(sys.argv[1]))
job = {"job_id": "keras-" + sys.argv[3], "model": spec, "seed": 3, "batch_size": 32,
       "epochs": 1, "max_steps": 40, "optimizer": {"name": "adam", "lr": 0.001},
       "dataset": {"name": "synthetic", "train_size": 512, "test_size": 1000},
       "eval_interval_s": 0}
json.dump(job, open(sys.argv[2], "w"), indent=1)
PY
}

onnx_py=${PS_ONNX_VENV:-$build/venv-onnx}/bin/python
for name in seq chain res bn resbn; do
  k3=()
  case $name in chain | res | resbn) k3=(--keras3) ;; esac
  "$build/ps-import-keras" --model "$out/$name.json" --out "$out/$name.spec.json" \
    2>"$out/$name.import.log" || { cat "$out/$name.import.log"; fail "$name: ps-import-keras failed"; }
  job "$name"
  "$build/ps-import-keras" --model "$out/$name.json" --weights "$out/$name.npz" \
    --job "$out/$name.job.json" --checkpoint-dir "$out/$name.ckpt" 2>>"$out/$name.import.log" \
    || { cat "$out/$name.import.log"; fail "$name: ps-import-keras --weights failed"; }
  grep -q "starting checkpoint .*shard-0-of-1-v0.ckpt" "$out/$name.import.log" \
    || { cat "$out/$name.import.log"; fail "$name: no starting checkpoint named"; }
  "$build/onnx_check" --job "$out/$name.job.json" --checkpoints "$out/$name.ckpt" \
    --out "$out/$name.ours" >"$out/$name.check.log" 2>&1 \
    || { cat "$out/$name.check.log"; fail "$name: onnx_check failed"; }
  timeout 300 "${py[@]}" compare "$out/$name.json" "$out/$name.npz" "$out/$name.ours" "${k3[@]}" \
    >"$out/$name.compare.log" 2>&1 || { cat "$out/$name.compare.log"; fail "$name: Keras and ps disagree"; }
  echo "keras_import: $name: $(grep -h 'ps-import-keras: .*P=' "$out/$name.import.log")"
  sed "s/^keras_compare: /keras_import: $name: /" "$out/$name.compare.log" | grep "^keras_import"
  case $name in bn | resbn) ;; *) continue ;; esac
  # The batch normalization's four arrays come out of ps-export as Keras
  # put them in (its first layer normalizes channels: no reordering).
  "$build/ps-export" --job "$out/$name.job.json" --checkpoints "$out/$name.ckpt" --out "$out/$name.npy" \
    >"$out/$name.export.log" 2>&1 || { cat "$out/$name.export.log"; fail "$name: ps-export failed"; }
  "$venv/bin/python" - "$out/$name.spec.json" "$out/$name.npz" "$out/$name.npy" "$name" <<'PY' \
    || fail "$name: ps-export's .npy files are not Keras's arrays"
import json, os, sys
import numpy as np
spec, z, d = json.load(open(sys.argv[1])), np.load(sys.argv[2]), sys.argv[3]
first = [l for l in spec["layers"] if l["type"] == "batchnorm"][0]["name"]
names = ("gamma", "beta", "moving_mean", "moving_variance")
# The Keras arrays of the first batch normalization follow its conv's kernel.
for i, what in enumerate(names):
    ours = np.load(os.path.join(d, f"{first}.{what}.npy"))
    if not np.array_equal(ours, z[f"arr_{1 + i}"]):
        sys.exit(f"{first}.{what}.npy differs from Keras's array {1 + i}")
for l in spec["layers"]:
    if l["type"] in ("conv2d", "dense") and l.get("bias") is False and \
            os.path.exists(os.path.join(d, l["name"] + ".b.npy")):
        sys.exit(f"{l['name']} has no bias but a .b.npy file")
print(f"keras_import: {sys.argv[4]}: ps-export's {first}.{{{','.join(names)}}}.npy are Keras's arrays; "
      "bias-less layers have no .b.npy")
PY
  if "$onnx_py" -c "import numpy, onnx, onnxruntime" 2>/dev/null; then
    "$build/ps-export" --job "$out/$name.job.json" --checkpoints "$out/$name.ckpt" --format onnx \
      --out "$out/$name.onnx" >>"$out/$name.export.log" 2>&1 \
      || { cat "$out/$name.export.log"; fail "$name: ps-export --format onnx failed"; }
    "$onnx_py" "$here/tools/onnx_compare.py" "$out/$name.onnx" "$out/$name.ours" \
      >"$out/$name.onnx.log" 2>&1 || { cat "$out/$name.onnx.log"; fail "$name: onnxruntime and ps disagree"; }
    sed -n "s/^onnx_compare: /keras_import: $name: onnxruntime: /p" "$out/$name.onnx.log"
  else
    echo "keras_import: $name: no onnxruntime venv at ${onnx_py%/bin/python}: the ONNX export is not run"
  fi
done

# Training from Keras's weights: the server restores the starting
# checkpoint (version 0) and a worker trains on (the batch-normalized
# model's moving statistics among what it restores and averages).
for name in seq bn; do
  port=$(free_port)
  "$build/ps-server" --insecure --job "$out/$name.job.json" --ps "127.0.0.1:$port" --index 0 \
    --checkpoint-dir "$out/$name.ckpt" --checkpoint-secs 3600 >"$out/$name.server.log" 2>&1 &
  spid=$!
  pids+=($spid)
  timeout 120 "$build/ps-worker" --insecure --ps "127.0.0.1:$port" --index 0 --num-workers 1 \
    --threads 1 --log-interval 0 >"$out/$name.worker.log" 2>&1 \
    || { tail -5 "$out/$name.worker.log"; fail "$name: the worker failed"; }
  kill -TERM "$spid"
  wait "$spid" || { tail -5 "$out/$name.server.log"; fail "$name: ps-server did not exit 0 on SIGTERM"; }
  grep -q "checkpoint: restored \[0, [0-9]*) at version 0" "$out/$name.server.log" \
    || { cat "$out/$name.server.log"; fail "$name: the server did not restore the Keras weights"; }
  acc=$(sed -n 's/^final test accuracy \([0-9.]*\).*/\1/p' "$out/$name.worker.log" | tail -1)
  [ -n "$acc" ] || { tail -5 "$out/$name.worker.log"; fail "$name: the worker reported no accuracy"; }
  echo "keras_import: $name: one server restored the Keras weights; a worker trained from them (test accuracy $acc)"
done

# Bad input: nothing is written.
"$build/ps-import-keras" --model "$out/seq.json" --weights "$out/chain.npz" --job "$out/seq.job.json" \
  --checkpoint-dir "$out/bad1" 2>"$out/bad1.log" && fail "another model's weights were taken"
grep -q "weight arrays for a model with" "$out/bad1.log" || { cat "$out/bad1.log"; fail "bad1: no cause given"; }
"$build/ps-import-keras" --model "$out/chain.json" --weights "$out/chain.npz" --job "$out/seq.job.json" \
  --checkpoint-dir "$out/bad2" 2>"$out/bad2.log" && fail "a job of another model was taken"
grep -q "is not this Keras model's spec" "$out/bad2.log" || { cat "$out/bad2.log"; fail "bad2: no cause given"; }
[ ! -e "$out/bad1" ] && [ ! -e "$out/bad2" ] || fail "a refused import left files behind"
echo "keras_import: another model's weights and a job of another model are refused, nothing written"
