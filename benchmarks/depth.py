"""Peak memory and step time versus depth, for plain tf.gradients and memsave.

Run ``python -m benchmarks.depth`` (depths 8..256) or ``--demo`` (8..128,
a few minutes on 2 cores). Writes JSON (machine, TF version, every figure,
and the growth/ratio checks), a Markdown table and two PNG plots (memory vs
depth, step-time ratio vs depth) to ``benchmarks/results/``. Peers run in the same process: Grappler's
RECOMPUTATION_HEURISTICS memory optimizer (Session) and tf.recompute_grad
over blocks of ceil(sqrt(n)) layers (tf.function). Step-time ratios are the
median over alternating (plain, method) pairs.

The meter is memsave.profile.peak_memory: allocator peak above the pre-step
baseline, BFC allocator, one inter-op thread, measured on CPU.
"""

import json
import math
import os
import platform
import statistics
import sys
import time

from benchmarks import cli

cli.environment()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_inter_op_parallelism_threads(1)

import memsave  # noqa: E402
from memsave.profile import peak_memory, session_step  # noqa: E402

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


def _grappler_config():
    from tensorflow.core.protobuf import rewriter_config_pb2  # pylint: disable=import-outside-toplevel
    rewrite = rewriter_config_pb2.RewriterConfig(
        memory_optimization=rewriter_config_pb2.RewriterConfig.RECOMPUTATION_HEURISTICS)
    # One inter-op thread, like the other Sessions (which take the context's).
    return tf.compat.v1.ConfigProto(
        inter_op_parallelism_threads=1,
        graph_options=tf.compat.v1.GraphOptions(rewrite_options=rewrite))


def session_step_for(model, n, method):
    """(step callable, session, rewrite seconds) for one Session configuration.

    ``method`` is 'plain', 'grappler' (plain gradients with Grappler's
    RECOMPUTATION_HEURISTICS memory optimizer) or a memsave strategy.
    """
    graph = tf.Graph()
    with graph.as_default():
        rng = np.random.RandomState(0)
        ws, layer = MODELS[model](n, rng)
        h = tf.constant(rng.randn(BATCH, WIDTH).astype(np.float32))
        for i in range(n):
            h = layer(h, i)
        loss = tf.reduce_mean(h * h)
        start = time.perf_counter()
        if method in ("plain", "grappler"):
            grads = tf.gradients(loss, ws)
        else:
            grads = memsave.gradients(loss, ws, checkpoints=method)
        rewrite_s = time.perf_counter() - start
        sess = tf.compat.v1.Session(graph=graph,
                                    config=_grappler_config() if method == "grappler" else None)
        sess.run(tf.compat.v1.global_variables_initializer())
    return session_step(sess, grads), sess, rewrite_s


def time_ratio(step, base, repeats):
    """Median over pairs of (step time / base time), the two run alternately."""
    step()
    base()
    ratios, times = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        base()
        mid = time.perf_counter()
        step()
        end = time.perf_counter()
        ratios.append((end - mid) / (mid - start))
        times.append(end - mid)
    return statistics.median(ratios), statistics.median(times)


def recompute_grad_blocks(layers):
    """``layers`` (callables h -> h) in blocks of ceil(sqrt(n)), each under
    tf.recompute_grad (also used by benchmarks.models)."""
    size = int(math.ceil(math.sqrt(len(layers))))
    blocks = []
    for start in range(0, len(layers), size):
        def block(h, group=tuple(layers[start:start + size])):
            for layer in group:
                h = layer(h)
            return h
        blocks.append(tf.recompute_grad(block))
    return blocks


def recompute_grad_step(model, n):
    """tf.recompute_grad over blocks of ceil(sqrt(n)) layers, inside tf.function."""
    rng = np.random.RandomState(0)
    ws, layer = MODELS[model](n, rng)
    x = tf.constant(rng.randn(BATCH, WIDTH).astype(np.float32))
    blocks = recompute_grad_blocks([lambda h, i=i: layer(h, i) for i in range(n)])

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            h = x
            for b in blocks:
                h = b(h)
            loss = tf.reduce_mean(h * h)
        return tape.gradient(loss, ws)
    return step


def run(depths, models, methods, repeats, peers):
    rows = []
    for model in models:
        for n in depths:
            base, base_sess, _ = session_step_for(model, n, "plain")
            configs = [(m, "session") for m in methods] + (
                [("grappler", "session"), ("tf.recompute_grad", "tf.function")] if peers else [])
            for method, mode in configs:
                sess, rewrite_s = None, None
                try:
                    if method == "tf.recompute_grad":
                        step = recompute_grad_step(model, n)
                    elif method == "plain":
                        step = base
                    else:
                        step, sess, rewrite_s = session_step_for(model, n, method)
                except memsave.NoBottleneckError:
                    continue
                peak = peak_memory(step) / ACTIVATION
                ratio, seconds = time_ratio(step, base, repeats)
                if sess is not None:
                    sess.close()
                rows.append(dict(model=model, depth=n, method=method, mode=mode,
                                 peak_activations=round(peak, 2),
                                 step_ms=round(seconds * 1e3, 2),
                                 time_ratio=None if method == "plain" else round(ratio, 3),
                                 rewrite_s=None if rewrite_s is None else round(rewrite_s, 3)))
                print("%-7s n=%-4d %-17s peak %7.1f act  step %7.1f ms  ratio %.2f" % (
                    model, n, method, peak, seconds * 1e3, ratio), file=sys.stderr)
            base_sess.close()
    return rows


def checks(rows):
    """The figures the benchmark issue asks for, computed from the rows."""
    out = {}
    for model in sorted({r["model"] for r in rows}):
        def peak(method, n):
            hit = [r["peak_activations"] for r in rows
                   if r["model"] == model and r["method"] == method and r["depth"] == n]
            return hit[0] if hit else None
        depths = sorted({r["depth"] for r in rows if r["model"] == model})
        top, mid = depths[-1], (64 if 64 in depths else depths[len(depths) // 2])
        entry = {"depths": [mid, top]}
        for method in ("plain", "memory", "optimal"):
            a, b = peak(method, mid), peak(method, top)
            if a and b:
                entry["%s_growth_%d_vs_%d" % (method, top, mid)] = round(b / a, 2)
        entry["memory_time_ratio_by_depth"] = {
            str(r["depth"]): r["time_ratio"] for r in sorted(rows, key=lambda r: r["depth"])
            if r["model"] == model and r["method"] == "memory"}
        ours = [peak(m, top) for m in ("memory", "optimal", "speed") if peak(m, top)]
        if ours and peak("plain", top):
            entry["best_memsave_vs_plain_at_%d" % top] = round(peak("plain", top) / min(ours), 2)
        out[model] = entry
    return out


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
                ratio = "" if r["time_ratio"] is None else " (%.2f×)" % r["time_ratio"]
                cells.append("%.1f%s" % (r["peak_activations"], ratio))
            lines.append("| %d | %s |" % (n, " | ".join(cells)))
        lines.append("")
    return "\n".join(lines)


# Lines that coincide ('memory' and 'optimal', 'speed' and 'grappler' often
# do) stay visible with different markers and dashes.
_STYLES = {"plain": ("o", "-"), "memory": ("s", "--"), "optimal": ("o", "-"),
           "speed": ("^", "-"), "grappler": ("x", ":"), "tf.recompute_grad": ("D", "-")}


def _style(method):
    marker, line = _STYLES.get(method, ("o", "-"))
    return dict(marker=marker, linestyle=line, markerfacecolor="none" if line != "-" else None)


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
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=method, **_style(method))
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


def plot_time(rows, path):
    """Step-time ratio to plain vs depth, one panel per model."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        for method in sorted({r["method"] for r in rows if r["model"] == model} - {"plain"}):
            pts = sorted((r["depth"], r["time_ratio"]) for r in rows
                         if r["model"] == model and r["method"] == method
                         and r["time_ratio"] is not None)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=method, **_style(method))
        ax.axhline(1.0, color="k", lw=1)
        ax.axhline(1.35, color="k", ls=":", lw=1, label="1.35× target")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("depth (layers / blocks)")
        ax.set_ylabel("step time / plain step time (median of pairs)")
        ax.set_title("%s, CPU" % model)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = cli.parser(__doc__)
    parser.add_argument("--demo", action="store_true", help="a subset that runs in minutes")
    parser.add_argument("--depths", type=int, nargs="*")
    parser.add_argument("--repeats", type=int, help="timed pairs per method (5; demo 3)")
    parser.add_argument("--no-peers", action="store_true", help="skip tf.recompute_grad, Grappler")
    parser.add_argument("--stem", help="output file name stem")
    args = cli.parse(parser, argv)
    depths = args.depths or ([8, 16, 32, 64, 128] if args.demo else [8, 16, 32, 64, 128, 256])
    methods = ["plain", "memory", "optimal", "speed"]
    repeats = args.repeats or (3 if args.demo else 5)
    rows = run(depths, ["chain", "resnet"], methods, repeats, peers=not args.no_peers)
    stem = args.stem or ("depth_demo" if args.demo else "depth")
    meta = dict(tf_version=tf.__version__, python=platform.python_version(),
                machine=platform.machine(), processor=platform.processor(),
                cpus=os.cpu_count(), batch=BATCH, width=WIDTH, activation_bytes=ACTIVATION,
                meter="allocator peak above pre-step baseline, BFC, 1 inter-op thread, CPU")
    summary = checks(rows)
    table = markdown(rows, methods + ["grappler", "tf.recompute_grad"])
    out = cli.write(args.out, stem, dict(meta=meta, rows=rows, checks=summary), table)
    plot(rows, out / (stem + ".png"))
    plot_time(rows, out / (stem + "_time.png"))
    print(table)
    print("checks: %s" % json.dumps(summary))
    print("wrote %s.{json,md,png} and %s_time.png in %s" % (stem, stem, out))


if __name__ == "__main__":
    main()
