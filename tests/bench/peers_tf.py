"""TensorFlow side of tests/bench/peers.sh: a job file's model as a tf_keras
Sequential model, trained on the Fashion-MNIST IDX files ps-worker reads.

  peers_tf.py single --job FILE --out JSON [options]
      one process, tf_keras model.fit: examples/s over --steps steps after
      --warmup steps, then a fresh model trained for --epochs epochs with the
      test split evaluated every --eval-s seconds
  peers_tf.py ps --job FILE --out JSON --logdir DIR [options]
      ParameterServerStrategy: --ps parameter servers and --workers workers
      as local processes on loopback, this process the chief (coordinator),
      a custom loop of coordinator.schedule; the same two phases
  peers_tf.py server --cluster JSON --type ps|worker --index I
      one task of that cluster (started by `ps`)

Each writes its figures as one JSON object to --out: examples_per_sec,
test_accuracy, time_to_target_s (seconds of training until the first
evaluation at or above --target, evaluations included; null if never),
evals ([seconds, accuracy] pairs), train_s, steps.
"""
import argparse
import faulthandler
import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pylib"))
from ports import free_ports  # noqa: E402

TRAIN_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte")
TEST_FILES = ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def idx_path(data_dir, name):
    """The IDX file `name` in data_dir, gzipped or plain, as ps-worker accepts."""
    for cand in (name + ".gz", name):
        p = os.path.join(data_dir, cand)
        if os.path.exists(p):
            return p
    sys.exit(f"peers_tf: no {name}[.gz] in {data_dir} (the dataset-fashion-mnist package)")


def read_idx(path):
    """An IDX file as a numpy array (big-endian header: magic, then dims)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    magic = int.from_bytes(raw[0:4], "big")
    if magic >> 8 != 0x08:  # 0x08: unsigned bytes
        sys.exit(f"peers_tf: {path}: bad magic {magic:#x}, not an IDX file of unsigned bytes")
    ndim = magic & 0xFF
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    header = 4 + 4 * ndim
    data = np.frombuffer(raw, dtype=np.uint8, offset=header)
    if data.size != int(np.prod(dims)):
        sys.exit(f"peers_tf: {path}: {data.size} bytes of data for dims {dims}")
    return data.reshape(dims), header


def load_split(data_dir, files):
    """(images uint8 (N, 28, 28, 1), labels int32 (N,))."""
    x, _ = read_idx(idx_path(data_dir, files[0]))
    y, _ = read_idx(idx_path(data_dir, files[1]))
    return x[..., None], y.astype(np.int32)


def build_model(job, keras):
    """The job's layers as a channels-last Sequential model giving logits."""
    c, h, w = job["model"]["input"]
    layers = [keras.Input(shape=(h, w, c))]
    for spec in job["model"]["layers"]:
        t = spec["type"]
        if t == "conv2d":
            layers.append(keras.layers.Conv2D(spec["filters"], spec["kernel"], strides=spec.get("stride", 1),
                                              padding=spec.get("padding", "valid")))
        elif t == "relu":
            layers.append(keras.layers.ReLU())
        elif t == "maxpool":
            layers.append(keras.layers.MaxPool2D(spec["size"], strides=spec.get("stride", spec["size"])))
        elif t == "flatten":
            layers.append(keras.layers.Flatten())
        elif t == "dense":
            layers.append(keras.layers.Dense(spec["units"]))
        elif t == "dropout":
            layers.append(keras.layers.Dropout(spec["rate"]))
        elif t == "softmax_xent":
            pass  # the loss takes the logits
        else:
            sys.exit(f"peers_tf: layer type '{t}' has no tf_keras counterpart here")
    return keras.Sequential(layers)


def make_optimizer(job, keras):
    opt = job.get("optimizer", {})
    if opt.get("name", "adam") != "adam":
        sys.exit("peers_tf: only the adam optimizer is mapped")
    return keras.optimizers.Adam(learning_rate=opt.get("lr", 0.001), beta_1=opt.get("beta1", 0.9),
                                 beta_2=opt.get("beta2", 0.999), epsilon=opt.get("eps", 1e-8))


def first_at_or_above(evals, target):
    for t, acc in evals:
        if acc >= target:
            return t
    return None


def write_result(path, res):
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res))


def common_args(p):
    p.add_argument("--job", required=True)
    p.add_argument("--data-dir", help="default: the job's dataset dir")
    p.add_argument("--steps", type=int, default=300, help="steps timed for examples/s")
    p.add_argument("--warmup", type=int, default=30, help="steps before the timing")
    p.add_argument("--epochs", type=int, default=3, help="epochs of the accuracy run; 0: none")
    p.add_argument("--max-steps", type=int, default=0, help="cap on the accuracy run's steps; 0: none")
    p.add_argument("--eval-s", type=float, default=20.0, help="seconds between evaluations")
    p.add_argument("--target", type=float, default=0.89)
    p.add_argument("--out", required=True)


def job_and_data(a):
    job = json.load(open(a.job))
    data_dir = a.data_dir or job.get("dataset", {}).get("dir", "/usr/share/datasets/fashion-mnist")
    return job, data_dir


def accuracy_steps(a, n_train, batch):
    per_epoch = -(-n_train // batch)
    steps = per_epoch * a.epochs
    return min(steps, a.max_steps) if a.max_steps > 0 else steps


# ---- one process ----------------------------------------------------------

def run_single(a):
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(a.threads)
    tf.config.threading.set_inter_op_parallelism_threads(a.threads)
    import tf_keras as keras

    job, data_dir = job_and_data(a)
    batch = job.get("batch_size", 64)
    xtr, ytr = load_split(data_dir, TRAIN_FILES)
    xte, yte = load_split(data_dir, TEST_FILES)
    tf.random.set_seed(job.get("seed", 1))

    def train_ds():
        ds = tf.data.Dataset.from_tensor_slices((xtr, ytr)).shuffle(len(ytr), reshuffle_each_iteration=True)
        ds = ds.repeat().batch(batch, drop_remainder=True)
        return ds.map(lambda x, y: (tf.cast(x, tf.float32) / 255.0, y)).prefetch(2)

    test_x = tf.constant(xte.astype(np.float32) / 255.0)
    test_y = tf.constant(yte)

    def compiled():
        m = build_model(job, keras)
        m.compile(optimizer=make_optimizer(job, keras),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        return m

    res = {"system": "tf1", "tensorflow": tf.__version__, "tf_keras": keras.__version__, "threads": a.threads,
           "batch": batch}
    # examples/s: one fit, timed from the end of its warm-up steps (tracing,
    # first allocations) to its end
    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, b, logs=None):
            if b + 1 == a.warmup:
                self.t0 = time.perf_counter()

        def on_train_end(self, logs=None):
            self.t1 = time.perf_counter()

    clock = Clock()
    clock.t0 = time.perf_counter()  # no warm-up: from the start of the fit
    m = compiled()
    m.fit(train_ds(), steps_per_epoch=a.warmup + a.steps, epochs=1, verbose=0, callbacks=[clock])
    dt = clock.t1 - clock.t0
    res.update(examples_per_sec=a.steps * batch / dt, timed_steps=a.steps, timed_s=dt)
    print(f"tf1: {a.steps} steps of {batch} in {dt:.1f} s: {res['examples_per_sec']:.0f} examples/s", flush=True)

    steps = accuracy_steps(a, len(ytr), batch)
    if steps > 0:
        m = compiled()

        @tf.function
        def correct(x, y):
            pred = tf.argmax(m(x, training=False), axis=1, output_type=tf.int32)
            return tf.reduce_sum(tf.cast(tf.equal(pred, y), tf.int32))

        def evaluate():
            n = sum(int(correct(test_x[i:i + 1000], test_y[i:i + 1000])) for i in range(0, len(yte), 1000))
            return n / len(yte)

        evals = []

        class Evaluations(keras.callbacks.Callback):
            def on_train_begin(self, logs=None):
                self.t0 = self.last = time.perf_counter()

            def on_train_batch_end(self, b, logs=None):
                self.steps = getattr(self, "steps", 0) + 1
                if self.steps >= steps:
                    self.model.stop_training = True
                elif time.perf_counter() - self.last >= a.eval_s:
                    acc = evaluate()
                    now = time.perf_counter()
                    evals.append([now - self.t0, acc])
                    print(f"tf1: {now - self.t0:.1f} s: test accuracy {acc:.4f}", flush=True)
                    self.last = now

        cb = Evaluations()
        per_epoch = -(-len(ytr) // batch)
        m.fit(train_ds(), steps_per_epoch=per_epoch, epochs=-(-steps // per_epoch), verbose=0, callbacks=[cb])
        acc = evaluate()
        train_s = time.perf_counter() - cb.t0
        evals.append([train_s, acc])
        res.update(test_accuracy=acc, train_s=train_s, steps=cb.steps,
                   evals=evals, time_to_target_s=first_at_or_above(evals, a.target))
        print(f"tf1: final test accuracy {acc:.4f} after {train_s:.1f} s", flush=True)
    write_result(a.out, res)


# ---- ParameterServerStrategy ----------------------------------------------

def die_with_parent():
    """In a task's process before exec: SIGKILL when the chief's process
    ends. A signal handler in the chief would not do: the chief spends its
    time blocked inside TensorFlow, where Python runs no handler."""
    import ctypes
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def run_server(a):
    """One ps or worker task: serves until it is killed."""
    import tensorflow as tf
    cluster = tf.train.ClusterSpec(json.loads(a.cluster))
    # Only the intra-op pool is narrowed: a task with one inter-op thread
    # can block it on a receive that waits for another op of the same task.
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=a.threads)
    server = tf.distribute.Server(cluster, job_name=a.type, task_index=a.index, protocol="grpc",
                                  config=config, start=True)
    print(f"tfps: {a.type} {a.index} serving at {server.target}", flush=True)
    server.join()


def wait_listening(addrs, deadline):
    """Waits until every address accepts a TCP connection, up to deadline."""
    for addr in addrs:
        host, port = addr.rsplit(":", 1)
        while True:
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    sys.exit(f"tfps: {addr} did not listen in time")
                time.sleep(0.2)


def run_ps(a):
    job, data_dir = job_and_data(a)
    batch = job.get("batch_size", 64)
    ports = free_ports(a.ps + a.workers + 1)
    spec = {"ps": [f"127.0.0.1:{p}" for p in ports[:a.ps]],
            "worker": [f"127.0.0.1:{p}" for p in ports[a.ps:a.ps + a.workers]],
            "chief": [f"127.0.0.1:{ports[-1]}"]}
    os.makedirs(a.logdir, exist_ok=True)
    children = []

    def stop_children(*_):
        for p in children:
            if p.poll() is None:
                p.terminate()
        end = time.monotonic() + 5
        for p in children:
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    try:
        env = dict(os.environ, TF_NUM_INTRAOP_THREADS=str(a.task_threads))
        for kind in ("ps", "worker"):
            for i in range(len(spec[kind])):
                log = open(os.path.join(a.logdir, f"{kind}-{i}.log"), "w")
                children.append(subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), "server", "--cluster", json.dumps(spec),
                     "--type", kind, "--index", str(i), "--threads", str(a.task_threads)],
                    stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent))
        wait_listening(spec["ps"] + spec["worker"], time.monotonic() + 120)
        chief(a, job, data_dir, batch, spec)
    finally:
        stop_children()


def chief(a, job, data_dir, batch, spec):
    import tensorflow as tf
    # The tasks' eager contexts take the chief's thread settings.
    tf.config.threading.set_intra_op_parallelism_threads(a.task_threads)
    import tf_keras as keras

    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(spec), task_type="chief", task_id=0, rpc_layer="grpc")
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
    # The workers read the same IDX files with TF ops, so the data need not
    # travel inside the dataset function: checked here against numpy.
    xtr, img_header = read_idx(idx_path(data_dir, TRAIN_FILES[0]))
    ytr, lab_header = read_idx(idx_path(data_dir, TRAIN_FILES[1]))
    n_train = len(ytr)
    img_path, lab_path = idx_path(data_dir, TRAIN_FILES[0]), idx_path(data_dir, TRAIN_FILES[1])
    xte, yte = load_split(data_dir, TEST_FILES)
    tf.random.set_seed(job.get("seed", 1))

    def read_tf(path, header):
        raw = tf.io.read_file(path)
        if path.endswith(".gz"):
            raw = tf.io.decode_compressed(raw, compression_type="GZIP")
        return tf.io.decode_raw(raw, tf.uint8)[header:]

    def dataset_fn():
        x = tf.reshape(read_tf(img_path, img_header), [n_train, 28, 28, 1])
        y = tf.cast(read_tf(lab_path, lab_header), tf.int32)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(n_train, reshuffle_each_iteration=True)
        ds = ds.repeat().batch(batch, drop_remainder=True)
        return ds.map(lambda x, y: (tf.cast(x, tf.float32) / 255.0, y)).prefetch(2)

    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                         reduction=keras.losses.Reduction.NONE)

    def trainer():
        """A fresh model and optimizer on the ps tasks, and its scheduled step."""
        with strategy.scope():
            model = build_model(job, keras)
            opt = make_optimizer(job, keras)

        @tf.function
        def step_fn(iterator):
            def step(x, y):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(loss_fn(y, model(x, training=True)))
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables))
                return loss
            x, y = next(iterator)
            return strategy.run(step, args=(x, y))
        return model, step_fn

    per_worker_iter = iter(coord.create_per_worker_dataset(dataset_fn))
    res = {"system": "tfps", "tensorflow": tf.__version__, "tf_keras": keras.__version__, "ps": a.ps,
           "workers": a.workers, "task_threads": a.task_threads, "batch": batch}

    model, step_fn = trainer()
    for _ in range(a.warmup):
        coord.schedule(step_fn, args=(per_worker_iter,))
    coord.join()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        coord.schedule(step_fn, args=(per_worker_iter,))
    coord.join()
    dt = time.perf_counter() - t0
    res.update(examples_per_sec=a.steps * batch / dt, timed_steps=a.steps, timed_s=dt)
    print(f"tfps: {a.steps} steps of {batch} on {a.workers} workers in {dt:.1f} s: "
          f"{res['examples_per_sec']:.0f} examples/s", flush=True)

    steps = accuracy_steps(a, n_train, batch)
    if steps > 0:
        model, step_fn = trainer()
        test_x = tf.constant(xte.astype(np.float32) / 255.0)
        test_y = tf.constant(yte)

        @tf.function
        def correct(x, y):
            pred = tf.argmax(model(x, training=False), axis=1, output_type=tf.int32)
            return tf.reduce_sum(tf.cast(tf.equal(pred, y), tf.int32))

        def evaluate():  # on the chief, reading the variables from the ps tasks
            n = sum(int(correct(test_x[i:i + 1000], test_y[i:i + 1000])) for i in range(0, len(yte), 1000))
            return n / len(yte)

        evals = []
        t0 = last = time.perf_counter()
        done = 0
        while done < steps:
            chunk = min(50, steps - done)
            for _ in range(chunk):
                coord.schedule(step_fn, args=(per_worker_iter,))
            coord.join()
            done += chunk
            if time.perf_counter() - last >= a.eval_s and done < steps:
                acc = evaluate()
                last = time.perf_counter()
                evals.append([last - t0, acc])
                print(f"tfps: {last - t0:.1f} s, step {done}: test accuracy {acc:.4f}", flush=True)
        acc = evaluate()
        train_s = time.perf_counter() - t0
        evals.append([train_s, acc])
        res.update(test_accuracy=acc, train_s=train_s, steps=done, evals=evals,
                   time_to_target_s=first_at_or_above(evals, a.target))
        print(f"tfps: final test accuracy {acc:.4f} after {train_s:.1f} s", flush=True)
    write_result(a.out, res)


def main():
    faulthandler.register(signal.SIGUSR1)  # kill -USR1 PID: the Python stacks, for a hang
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("single")
    common_args(s)
    s.add_argument("--threads", type=int, default=2, help="intra- and inter-op threads")
    ps = sub.add_parser("ps")
    common_args(ps)
    ps.add_argument("--ps", type=int, default=2)
    ps.add_argument("--workers", type=int, default=2)
    ps.add_argument("--task-threads", type=int, default=1, help="threads of each ps and worker task")
    ps.add_argument("--logdir", required=True)
    sv = sub.add_parser("server")
    sv.add_argument("--cluster", required=True)
    sv.add_argument("--type", choices=("ps", "worker"), required=True)
    sv.add_argument("--index", type=int, required=True)
    sv.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    {"single": run_single, "ps": run_ps, "server": run_server}[a.cmd](a)


if __name__ == "__main__":
    main()
