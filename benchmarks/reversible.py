"""Peak memory and step time versus depth for reversible blocks and a plain tape.

Run ``python -m benchmarks.reversible`` (depths 8, 32, 128; about a minute
on 2 cores). The model is a stack of ``ReversibleResidual`` blocks on a
4096 x 64 float32 input (one activation = 1 MiB); F and G are
``tanh(h @ W)`` with 32 x 32 weights (4 KiB each). One step is a
``tf.function`` computing the loss ``mean(y^2) + mean(log_det)`` and its
gradients w.r.t. every weight:

* ``plain tape``: ``seq(x, store_activations=True)``, every activation on
  the tape;
* ``reversible``: ``seq(x)``, inputs reconstructed in the backward pass;
* ``reversible, checked``: ``check_inverse=True, store_drifted=True``
  (a drift check of every block in every step; nothing drifts, so nothing
  is stored).

Writes JSON (machine, TF version, every figure) and a Markdown table to
``benchmarks/results/reversible.{json,md}``. The meter is
memsave.profile.peak_memory: allocator peak above the pre-step baseline,
BFC allocator, one inter-op thread, CPU.
"""

import json
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

from memsave import reversible as R  # noqa: E402
from memsave.profile import peak_memory  # noqa: E402

BATCH, WIDTH = 4096, 64          # one activation = 1 MiB of float32
ACTIVATION = BATCH * WIDTH * 4
MB = 2 ** 20
METHODS = ("plain tape", "reversible", "reversible, checked")


def _mlp(w):
    def f(h):
        return tf.tanh(tf.matmul(h, w))
    return f


def revnet_step(n, store, **seq_kwargs):
    """A tf.function train step over ``n`` ReversibleResidual blocks (also
    used by tests/test_reversible.py). ``store``: plain autodiff instead."""
    rng = np.random.RandomState(0)
    half = WIDTH // 2
    blocks, ws = [], []
    for _ in range(n):
        wf = tf.Variable((rng.randn(half, half) * 0.1).astype(np.float32))
        wg = tf.Variable((rng.randn(half, half) * 0.1).astype(np.float32))
        ws += [wf, wg]
        blocks.append(R.ReversibleResidual(_mlp(wf), _mlp(wg), variables=[wf, wg]))
    seq = R.ReversibleSequence(blocks, **seq_kwargs)
    x = tf.constant(rng.randn(BATCH, WIDTH).astype(np.float32))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            y, log_det = seq(x, store_activations=store)
            loss = tf.reduce_mean(y * y) + tf.reduce_mean(log_det)
        return tape.gradient(loss, ws)
    return step


def build_step(n, method):
    checked = method == "reversible, checked"
    return revnet_step(n, method == "plain tape", check_inverse=checked,
                       store_drifted=checked)


def step_ms(step, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def run(depths, repeats):
    rows = []
    for n in depths:
        for method in METHODS:
            start = time.perf_counter()
            step = build_step(n, method)
            step()
            trace_s = time.perf_counter() - start
            peak = peak_memory(step)
            ms = step_ms(step, repeats)
            rows.append(dict(depth=n, method=method, peak_mb=round(peak / MB, 2),
                             peak_activations=round(peak / ACTIVATION, 2),
                             step_ms=round(ms, 1), trace_s=round(trace_s, 1)))
            print("n=%-4d %-20s peak %7.2f MB  step %7.1f ms  trace %.1f s"
                  % (n, method, peak / MB, ms, trace_s), file=sys.stderr)
    return rows


def checks(rows):
    def peak(method, n):
        hit = [r["peak_mb"] for r in rows if r["method"] == method and r["depth"] == n]
        return hit[0] if hit else None
    depths = sorted({r["depth"] for r in rows})
    lo, hi = depths[0], depths[-1]
    out = {"depths": [lo, hi]}
    for method in METHODS:
        if peak(method, lo) and peak(method, hi):
            growth = peak(method, hi) / peak(method, lo)
            out["%s growth %d vs %d" % (method, hi, lo)] = round(growth, 2)
    return out


def markdown(rows):
    lines = ["Peak memory of one training step in MB above the pre-step baseline "
             "(1 activation = %d KiB); median step time in brackets" % (ACTIVATION // 1024), "",
             "| blocks | " + " | ".join(METHODS) + " |",
             "|---|" + "---:|" * len(METHODS)]
    for n in sorted({r["depth"] for r in rows}):
        cells = []
        for m in METHODS:
            hit = [r for r in rows if r["depth"] == n and r["method"] == m]
            cells.append("%.1f (%.0f ms)" % (hit[0]["peak_mb"], hit[0]["step_ms"])
                         if hit else "—")
        lines.append("| %d | %s |" % (n, " | ".join(cells)))
    lines.append("")
    return "\n".join(lines)


def main(argv=None):
    parser = cli.parser(__doc__)
    parser.add_argument("--depths", type=int, nargs="*", default=[8, 32, 128])
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per row")
    args = cli.parse(parser, argv)
    rows = run(args.depths, args.repeats)
    meta = dict(tf_version=tf.__version__, python=platform.python_version(),
                machine=platform.machine(), processor=platform.processor(),
                cpus=os.cpu_count(), batch=BATCH, width=WIDTH, activation_bytes=ACTIVATION,
                meter="allocator peak above pre-step baseline, BFC, 1 inter-op thread, CPU")
    summary = checks(rows)
    table = markdown(rows)
    out = cli.write(args.out, "reversible", dict(meta=meta, rows=rows, checks=summary), table)
    print(table)
    print("checks: %s" % json.dumps(summary))
    print("wrote reversible.{json,md} in %s" % out)


if __name__ == "__main__":
    main()
