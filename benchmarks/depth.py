"""Peak memory and step time versus depth, for plain tf.gradients and memsave.

Run ``python -m benchmarks.depth`` (all depths) or ``--demo`` (a subset that
finishes in a few minutes on 2 cores). Writes JSON, a Markdown table and a
PNG plot to ``benchmarks/results/``.

The meter is memsave.profile.peak_memory: allocator peak above the pre-step
baseline, BFC allocator, one inter-op thread, measured on CPU.
"""

import argparse
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import time

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_inter_op_parallelism_threads(1)

import memsave  # noqa: E402
from memsave.profile import peak_memory, session_step  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
BATCH, WIDTH = 4096, 64          # one activation = 1 MiB of float32
ACTIVATION = BATCH * WIDTH * 4


def build_chain(n, rng):
    ws = [tf.Variable((rng.randn(WIDTH, WIDTH) / math.sqrt(WIDTH)).astype(np.float32))
          for _ in range(n)]

    def layer(h, i):
        return tf.tanh(tf.matmul(h, ws[i]))
    return ws, layer


def build_resnet(n, rng):
    ws = [tf.Variable((rng.randn(WIDTH, WIDTH) * 0.05).astype(np.float32)) for _ in range(2 * n)]

    def layer(h, i):
        return h + tf.matmul(tf.nn.relu(tf.matmul(h, ws[2 * i])), ws[2 * i + 1])
    return ws, layer


MODELS = {"chain": build_chain, "resnet": build_resnet}


def _timed(step, repeats):
    step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_session(model, n, method, repeats):
    """Peak (activations) and median step seconds for one Session configuration."""
    graph = tf.Graph()
    with graph.as_default():
        rng = np.random.RandomState(0)
        ws, layer = MODELS[model](n, rng)
        h = tf.constant(rng.randn(BATCH, WIDTH).astype(np.float32))
        for i in range(n):
            h = layer(h, i)
        loss = tf.reduce_mean(h * h)
        start = time.perf_counter()
        if method == "plain":
            grads = tf.gradients(loss, ws)
        else:
            grads = memsave.gradients(loss, ws, checkpoints=method)
        rewrite_s = time.perf_counter() - start
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            step = session_step(sess, grads)
            peak = peak_memory(step) / ACTIVATION
            seconds = _timed(step, repeats)
    return peak, seconds, rewrite_s


def measure_recompute_grad(model, n, repeats):
    """tf.recompute_grad over blocks of ceil(sqrt(n)) layers, inside tf.function."""
    rng = np.random.RandomState(0)
    ws, layer = MODELS[model](n, rng)
    x = tf.constant(rng.randn(BATCH, WIDTH).astype(np.float32))
    size = int(math.ceil(math.sqrt(n)))
    blocks = []
    for start in range(0, n, size):
        def block(h, start=start):
            for i in range(start, min(n, start + size)):
                h = layer(h, i)
            return h
        blocks.append(tf.recompute_grad(block))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            h = x
            for b in blocks:
                h = b(h)
            loss = tf.reduce_mean(h * h)
        return tape.gradient(loss, ws)

    peak = peak_memory(step) / ACTIVATION
    return peak, _timed(step, repeats)


def run(depths, models, methods, repeats, peers):
    rows = []
    for model in models:
        for n in depths:
            base = None
            for method in methods:
                try:
                    peak, seconds, rewrite_s = measure_session(model, n, method, repeats)
                except memsave.NoBottleneckError:
                    continue
                if method == "plain":
                    base = seconds
                rows.append(dict(model=model, depth=n, method=method, mode="session",
                                 peak_activations=round(peak, 2),
                                 step_ms=round(seconds * 1e3, 2),
                                 time_ratio=round(seconds / base, 3) if base else None,
                                 rewrite_s=round(rewrite_s, 3)))
                print("%-7s n=%-4d %-16s peak %7.1f act  step %7.1f ms" % (
                    model, n, method, peak, seconds * 1e3), file=sys.stderr)
            if peers:
                peak, seconds = measure_recompute_grad(model, n, repeats)
                rows.append(dict(model=model, depth=n, method="tf.recompute_grad",
                                 mode="tf.function", peak_activations=round(peak, 2),
                                 step_ms=round(seconds * 1e3, 2),
                                 time_ratio=round(seconds / base, 3) if base else None,
                                 rewrite_s=None))
    return rows


def markdown(rows, methods):
    lines = []
    for model in sorted({r["model"] for r in rows}):
        names = [m for m in methods if any(r["method"] == m and r["model"] == model for r in rows)]
        lines.append("**%s** — peak activations above baseline (1 activation = %d KiB); "
                     "step-time ratio to plain in brackets" % (model, ACTIVATION // 1024))
        lines.append("")
        lines.append("| depth | " + " | ".join(names) + " |")
        lines.append("|---|" + "---|" * len(names))
        for n in sorted({r["depth"] for r in rows if r["model"] == model}):
            cells = []
            for m in names:
                hit = [r for r in rows if r["model"] == model and r["depth"] == n and r["method"] == m]
                if not hit:
                    cells.append("—")
                    continue
                r = hit[0]
                ratio = "" if m == "plain" or r["time_ratio"] is None else " (%.2f×)" % r["time_ratio"]
                cells.append("%.1f%s" % (r["peak_activations"], ratio))
            lines.append("| %d | %s |" % (n, " | ".join(cells)))
        lines.append("")
    return "\n".join(lines)


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        for method in sorted({r["method"] for r in rows if r["model"] == model}):
            pts = sorted((r["depth"], r["peak_activations"]) for r in rows
                         if r["model"] == model and r["method"] == method)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
        depths = sorted({r["depth"] for r in rows if r["model"] == model})
        ax.plot(depths, [2 * math.sqrt(d) for d in depths], "k--", lw=1, label="2·√n")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("depth (layers / blocks)")
        ax.set_ylabel("peak memory above baseline (activations)")
        ax.set_title("%s, CPU, batch %d × width %d" % (model, BATCH, WIDTH))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", action="store_true", help="a subset that runs in minutes")
    parser.add_argument("--depths", type=int, nargs="*")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    depths = args.depths or ([8, 16, 32, 64, 128] if args.demo else [8, 16, 32, 64, 128, 256])
    methods = ["plain", "memory", "speed"]
    rows = run(depths, ["chain", "resnet"], methods, args.repeats, peers=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "depth_demo" if args.demo else "depth"
    meta = dict(tf_version=tf.__version__, python=platform.python_version(),
                machine=platform.machine(), processor=platform.processor(),
                cpus=os.cpu_count(), batch=BATCH, width=WIDTH, activation_bytes=ACTIVATION,
                meter="allocator peak above pre-step baseline, BFC, 1 inter-op thread, CPU")
    (out / (stem + ".json")).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    table = markdown(rows, methods + ["tf.recompute_grad"])
    (out / (stem + ".md")).write_text(table)
    plot(rows, out / (stem + ".png"))
    print(table)
    print("wrote %s.{json,md,png} in %s" % (stem, out))


if __name__ == "__main__":
    main()
