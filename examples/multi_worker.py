"""Data-parallel training on N local MultiWorkerMirroredStrategy workers, with and without memsave.

    python examples/multi_worker.py [--workers 2] [--batch 16] [--steps 5] [--keras] [--json PATH]

The launcher starts ``--workers`` processes on this machine, each a
``tf.distribute.MultiWorkerMirroredStrategy`` worker with its own
``TF_CONFIG`` (``{"cluster": {"worker": ["127.0.0.1:<port>", ...]},
"task": {"type": "worker", "index": i}}``), so each worker has its own
TensorFlow runtime and its own allocator. Every worker trains the ResNet of
``benchmarks/models.py`` (``build_resnet``: a stem, 16 basic blocks of 3x3
convolutions with batch norm, 32 channels at 32x32, a pooled linear head;
raw TF ops and ``tf.Variable`` objects, created in the strategy's scope) on
its own shard of ``--batch`` examples, twice from the same initial weights:

* plain: a custom loop, ``strategy.run`` of a step that takes gradients
  with ``tf.GradientTape``, all-reduces them across the workers
  (``ReplicaContext.all_reduce('SUM', ...)``) and applies SGD with
  ``assign_sub``;
* memsave: the same step with ``memsave.GradientTape(checkpoints='optimal')``.

Each worker measures its own peak memory (``memsave.profile.peak_memory``
on its GPU:0 if it has one, else its CPU: allocator peak above the pre-step
baseline, BFC allocator, one inter-op thread) and step time (median over
``--steps`` alternating plain/memsave steps), and compares the weights after
the same number of steps. The launcher prints one row per worker and whether all workers ended
with the same weights.

``--keras`` also tries ``model.fit`` of a small Keras model under the same
strategy, plain and with ``memsave.keras.enable``. Keras 3.15 ``fit`` fails
by itself under ``MultiWorkerMirroredStrategy`` on TensorFlow 2.21 (see the
README), so the custom loop is the supported way; the flag reports what your
Keras does.

On a real cluster, run only the worker part on every host, with that host's
``TF_CONFIG`` (same cluster list everywhere, its own ``task.index``)::

    TF_CONFIG='{"cluster": {"worker": ["host0:12345", "host1:12345"]},
                "task": {"type": "worker", "index": 0}}' \\
        python examples/multi_worker.py --worker

The worker prints its own row (and writes ``--json`` if given).
"""

import argparse
import hashlib
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
MIB = 2 ** 20


# ---------------------------------------------------------------------------
# Worker

def _watch_parent(parent_pid):
    """Exit when the launcher is gone, so no worker outlives it."""
    def watch():
        while True:
            if os.getppid() != parent_pid:
                os._exit(3)  # pylint: disable=protected-access
            time.sleep(0.5)
    threading.Thread(target=watch, daemon=True).start()


def _digest(arrays):
    h = hashlib.sha256()
    for a in arrays:
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def _keras_fit(strategy, use_memsave, workers):
    """Weights after one epoch of Keras fit under ``strategy``, or the error."""
    import keras  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    import memsave.keras  # pylint: disable=import-outside-toplevel
    rng = np.random.RandomState(0)
    x = rng.randn(16 * workers, 16, 16, 3).astype("float32")
    y = rng.randint(0, 4, len(x))
    try:
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([
                keras.Input((16, 16, 3)),
                keras.layers.Conv2D(8, 3, padding="same"), keras.layers.BatchNormalization(),
                keras.layers.ReLU(),
                keras.layers.Conv2D(8, 3, padding="same"), keras.layers.BatchNormalization(),
                keras.layers.ReLU(),
                keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(4)])
            model.compile(keras.optimizers.SGD(0.05),
                          keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          jit_compile=False)
            if use_memsave:
                memsave.keras.enable(model, "optimal")
        model.fit(x, y, batch_size=4 * workers, epochs=1, shuffle=False, verbose=0)
        return {"ok": True, "weights": model.get_weights()}
    except Exception as e:  # pylint: disable=broad-except
        # The message prints the whole first batch; leave it out.
        message = re.sub(r"PerReplica:\{.*\}\)", "PerReplica:{...})", str(e), flags=re.S)
        if len(message) > 300:
            message = message[:150] + " ... " + message[-150:]
        return {"ok": False, "error": "%s: %s" % (type(e).__name__, " ".join(message.split()))}


def worker(args):
    """One MultiWorkerMirroredStrategy worker; returns its result dict."""
    # The meter needs the BFC allocator, read when the runtime starts.
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    if args.parent_pid:
        _watch_parent(args.parent_pid)

    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    # One inter-op thread fixes the execution order, so the peak repeats.
    tf.config.threading.set_inter_op_parallelism_threads(1)
    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)

    import memsave  # pylint: disable=import-outside-toplevel
    from memsave.profile import default_device, peak_memory  # pylint: disable=import-outside-toplevel
    from benchmarks.models import SIZES, build_resnet  # pylint: disable=import-outside-toplevel

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    task = strategy.cluster_resolver.task_id
    replicas = strategy.num_replicas_in_sync
    sizes = dict(SIZES["tiny" if args.tiny else "full"]["resnet"])
    if args.batch:
        sizes["batch"] = args.batch
    if args.blocks:
        sizes["blocks"] = args.blocks

    methods = {"plain": tf.GradientTape,
               "memsave": lambda: memsave.GradientTape(checkpoints=args.checkpoints)}
    runs = {}
    for name, make_tape in methods.items():
        with strategy.scope():   # mirrored variables, same initial values everywhere
            net = build_resnet(np.random.RandomState(0), sizes)
        # This worker's shard of the global batch.
        x = tf.constant(np.random.RandomState(1000 + task).randn(*net.x.shape)
                        .astype(np.float32))

        runs[name] = {"net": net,
                      "step": tf.function(sgd_step(strategy, net, x, make_tape, args.lr))}

    def run_once(name):
        out = runs[name]["step"]()
        return float(strategy.experimental_local_results(out)[0].numpy())

    # Every worker calls the same functions in the same order: each step
    # holds collectives that all workers must join.
    result = {"task": task, "workers": replicas, "sizes": sizes,
              "checkpoints": args.checkpoints, "threads": args.threads,
              "activation_mib": sizes["batch"] * sizes["size"] ** 2 * sizes["channels"] * 4 / MIB}
    for name in methods:
        start = time.perf_counter()
        run_once(name)
        result[name + "_first_step_s"] = time.perf_counter() - start   # trace (+ rewrite)
    device = default_device()    # this worker's GPU:0, else its CPU
    result["device"] = device
    for name in methods:
        result[name + "_peak_mib"] = peak_memory(runs[name]["step"], warmup=0,
                                                 device=device) / MIB
    times = {name: [] for name in methods}
    losses = {}
    for _ in range(args.steps):
        for name in methods:
            start = time.perf_counter()
            losses[name] = run_once(name)
            times[name].append(time.perf_counter() - start)
    ratios = [m / p for p, m in zip(times["plain"], times["memsave"])]
    weights = {name: [v.numpy() for v in runs[name]["net"].weights] for name in methods}
    scale = max(float(np.max(np.abs(w))) for w in weights["plain"])
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(weights["plain"], weights["memsave"]))
    result.update(
        steps_total=2 + args.steps,
        plain_step_s=float(np.median(times["plain"])),
        memsave_step_s=float(np.median(times["memsave"])),
        step_time_ratio=float(np.median(ratios)),
        saving=1 - result["memsave_peak_mib"] / result["plain_peak_mib"],
        weight_max_abs_diff=diff, weight_rel_diff=diff / scale,
        plain_digest=_digest(weights["plain"]), memsave_digest=_digest(weights["memsave"]),
        plain_loss=losses.get("plain"), memsave_loss=losses.get("memsave"))

    if args.keras:
        plain = _keras_fit(strategy, False, replicas)
        ours = _keras_fit(strategy, True, replicas)
        keras_result = {"plain": "ok" if plain["ok"] else plain["error"],
                        "memsave": "ok" if ours["ok"] else ours["error"]}
        if plain["ok"] and ours["ok"]:
            kscale = max(float(np.max(np.abs(w))) for w in plain["weights"])
            keras_result["weight_rel_diff"] = max(
                float(np.max(np.abs(a - b))) for a, b in zip(plain["weights"], ours["weights"])
            ) / kscale
        result["keras_fit"] = keras_result
    return result


# ---------------------------------------------------------------------------
# Launcher

def sgd_step(strategy, net, x, make_tape, lr):
    """One data-parallel SGD step on ``net``: each replica's gradients from a
    tape made by ``make_tape``, summed over all replicas, averaged into the update."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    def step():
        def replica_step():
            with make_tape() as tape:
                loss = net.forward(x)
            grads = tape.gradient(loss, net.weights)
            grads = tf.distribute.get_replica_context().all_reduce("SUM", grads)
            for v, g in zip(net.weights, grads):
                v.assign_sub(lr / strategy.num_replicas_in_sync * g)
            return loss
        return strategy.run(replica_step)
    return step


def free_ports(n):
    """``n`` distinct free TCP ports on 127.0.0.1 (bound to port 0, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def tf_config(ports, index):
    return json.dumps({"cluster": {"worker": ["127.0.0.1:%d" % p for p in ports]},
                       "task": {"type": "worker", "index": index}})


def _worker_argv(args, out_dir, index):
    argv = [sys.executable, str(pathlib.Path(__file__).resolve()), "--worker",
            "--json", str(out_dir / ("worker_%d.json" % index)),
            "--parent-pid", str(os.getpid()), "--steps", str(args.steps),
            "--lr", str(args.lr), "--checkpoints", args.checkpoints,
            "--threads", str(args.threads)]
    for flag in ("batch", "blocks"):
        if getattr(args, flag):
            argv += ["--" + flag, str(getattr(args, flag))]
    if args.tiny:
        argv.append("--tiny")
    if args.keras:
        argv.append("--keras")
    return argv


def _tail(path, n=3000):
    try:
        return pathlib.Path(path).read_text(errors="replace")[-n:]
    except OSError:
        return ""


def launch(args):
    """Start the workers, wait for all (or kill all), return their results."""
    ports = free_ports(args.workers)
    with tempfile.TemporaryDirectory(prefix="memsave_workers_") as tmp:
        out_dir = pathlib.Path(tmp)
        procs, logs = [], []
        try:
            for i in range(args.workers):
                env = dict(os.environ, TF_CONFIG=tf_config(ports, i),
                           TF_CPU_ALLOCATOR_USE_BFC="true")
                env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
                log = open(out_dir / ("worker_%d.log" % i), "wb")  # pylint: disable=consider-using-with
                logs.append(log)
                procs.append(subprocess.Popen(_worker_argv(args, out_dir, i), env=env,  # pylint: disable=consider-using-with
                                              stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
            deadline = time.monotonic() + args.timeout
            while any(p.poll() is None for p in procs):
                failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
                if failed:
                    # The others would wait for the failed one's collectives forever.
                    i = failed[0]
                    raise RuntimeError("worker %d exited with %d:\n%s" % (
                        i, procs[i].returncode, _tail(out_dir / ("worker_%d.log" % i))))
                if time.monotonic() > deadline:
                    raise TimeoutError("workers still running after %d s:\n%s" % (
                        args.timeout, _tail(out_dir / "worker_0.log")))
                time.sleep(0.2)
            failed = [i for i, p in enumerate(procs) if p.returncode != 0]
            if failed:
                i = failed[0]
                raise RuntimeError("worker %d exited with %d:\n%s" % (
                    i, procs[i].returncode, _tail(out_dir / ("worker_%d.log" % i))))
            return [json.loads((out_dir / ("worker_%d.json" % i)).read_text())
                    for i in range(args.workers)]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            for log in logs:
                log.close()


def table(results):
    lines = ["| worker | plain peak MiB | memsave peak MiB | saving | plain step s "
             "| memsave step s | step-time ratio | weights vs plain (rel.) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append("| %d | %.1f | %.1f | %.0f%% | %.3f | %.3f | %.2f× | %.1e |" % (
            r["task"], r["plain_peak_mib"], r["memsave_peak_mib"], 100 * r["saving"],
            r["plain_step_s"], r["memsave_step_s"], r["step_time_ratio"], r["weight_rel_diff"]))
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="local workers to launch")
    parser.add_argument("--batch", type=int, default=16,
                        help="examples per worker (benchmarks/models.py's full size: 8)")
    parser.add_argument("--blocks", type=int, help="ResNet basic blocks (default 16)")
    parser.add_argument("--steps", type=int, default=5,
                        help="timed steps per method (after one traced and one measured step)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--checkpoints", default="optimal", help="memsave strategy")
    parser.add_argument("--threads", type=int,
                        help="intra-op threads per worker (default: cores / workers)")
    parser.add_argument("--tiny", action="store_true",
                        help="benchmarks/models.py's tiny ResNet (for tests)")
    parser.add_argument("--keras", action="store_true",
                        help="also try Keras fit under the strategy, plain and with memsave")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before the "
                        "launcher kills the workers")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--worker", action="store_true",
                        help="run one worker (TF_CONFIG from the environment)")
    parser.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.workers < 1:
        parser.error("--steps and --workers must be at least 1")
    if args.tiny and args.batch == 16:
        args.batch = None
    if args.threads is None:
        args.threads = 0 if args.worker else max(1, (os.cpu_count() or 1) // args.workers)

    if args.worker:
        result = worker(args)
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
        if not args.parent_pid:
            print(table([result]))
        return result

    start = time.perf_counter()
    results = launch(args)
    wall = time.perf_counter() - start
    first = results[0]
    print("%d local MultiWorkerMirroredStrategy workers; ResNet of benchmarks/models.py (%s), "
          "%d examples per worker (one activation %.2f MiB); memsave checkpoints=%r; "
          "%d intra-op thread(s) per worker\n" % (
              len(results), ", ".join("%s=%s" % kv for kv in first["sizes"].items()
                                      if kv[0] != "batch"),
              first["sizes"]["batch"], first["activation_mib"], first["checkpoints"],
              args.threads))
    print(table(results))
    same = {r["plain_digest"] for r in results}, {r["memsave_digest"] for r in results}
    print("\npeak: allocator peak above the pre-step baseline in each worker; step time: "
          "median of %d alternating steps; weights compared after %d steps" % (
              args.steps, first["steps_total"]))
    print("weights identical on every worker: plain %s, memsave %s" % (
        "yes" if len(same[0]) == 1 else "NO", "yes" if len(same[1]) == 1 else "NO"))
    if args.keras:
        for r in results:
            k = r["keras_fit"]
            print("worker %d Keras fit: plain %s; memsave %s%s" % (
                r["task"], k["plain"], k["memsave"],
                "; weights vs plain %.1e" % k["weight_rel_diff"] if "weight_rel_diff" in k
                else ""))
    print("wall time %.1f s" % wall)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(
            {"workers": results, "wall_s": wall, "argv": sys.argv[1:]}, indent=1))
    return results


if __name__ == "__main__":
    main()
