"""Time to plan and rewrite real TF graphs of about 1k, 5k and 20k ops.

``python -m benchmarks.rewrite_speed`` builds residual MLPs of small matmuls
(block: h <- h + relu(h @ W1) @ W2, batch 128 x width 16, so every tensor
has 2048 elements, above memsave's default min_checkpoint_size of 1024) in a
compat.v1 Graph, with as many blocks as give the target number of forward
ops (``len(graph.get_operations())`` after building the forward pass,
variables' initializers included), and times:

* ``tf.gradients`` (the baseline every rewrite is compared with);
* ``memsave.plan`` with 'memory' and with 'optimal' (analysis + planning);
* ``memsave.gradients`` with 'memory' and with 'optimal' (analysis,
  planning and the rewrite, including the tf.gradients calls it makes).

tf.gradients and memsave.gradients add ops, so each of their runs gets a
fresh forward graph; memsave.plan adds none, so its runs share one.

Each figure is the median of 3 runs (``--quick``: 1k and 5k ops only). A
variant whose first run takes longer than ``--limit`` seconds (120) is
recorded with that one run, marked ``slow``, and not repeated. Writes
``benchmarks/results/rewrite_speed.{json,md}``, with seconds per 1k forward
ops and the growth exponent between sizes (1 = linear).
"""

import math
import os
import statistics
import sys
import time

from benchmarks import cli

cli.environment()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_inter_op_parallelism_threads(1)

import memsave  # noqa: E402
from benchmarks.models import machine_info  # noqa: E402

BATCH, WIDTH = 128, 16
SIZES = (1000, 5000, 20000)
QUICK_SIZES = (1000, 5000)
VARIANTS = ("tf.gradients", "plan memory", "plan optimal", "gradients memory",
            "gradients optimal")


def build_forward(blocks):
    """A residual MLP of ``blocks`` blocks in a new Graph: (graph, loss, weights)."""
    graph = tf.Graph()
    rng = np.random.RandomState(0)
    with graph.as_default():
        ws = [tf.Variable((rng.randn(WIDTH, WIDTH) * 0.1).astype(np.float32))
              for _ in range(2 * blocks)]
        h = tf.constant(rng.randn(BATCH, WIDTH).astype(np.float32))
        for i in range(blocks):
            h = h + tf.matmul(tf.nn.relu(tf.matmul(h, ws[2 * i])), ws[2 * i + 1])
        loss = tf.reduce_mean(h * h)
    return graph, loss, ws


def ops_per_block():
    """(fixed ops, ops per block), from two small builds."""
    a = len(build_forward(10)[0].get_operations())
    b = len(build_forward(20)[0].get_operations())
    per = (b - a) / 10.0
    return a - 10 * per, per


def blocks_for(target_ops, fixed, per):
    return max(1, int(round((target_ops - fixed) / per)))


def _call(variant, loss, ws):
    if variant == "tf.gradients":
        return tf.gradients(loss, ws)
    kind, strategy = variant.split()
    if kind == "plan":
        return memsave.plan(loss, ws, checkpoints=strategy)
    return memsave.gradients(loss, ws, checkpoints=strategy)


def time_variant(variant, blocks, runs, limit, shared=None, log=sys.stderr):
    """Seconds of each run, stopping early if slow. tf.gradients and
    memsave.gradients get a fresh forward graph each run (they add ops to
    it); memsave.plan adds nothing, so its runs share ``shared``."""
    seconds, info = [], {}
    for _ in range(runs):
        if variant.startswith("plan") and shared is not None:
            graph, loss, ws = shared
        else:
            graph, loss, ws = build_forward(blocks)
        with graph.as_default():
            start = time.perf_counter()
            out = _call(variant, loss, ws)
            seconds.append(time.perf_counter() - start)
        if variant.startswith("plan"):
            info = dict(checkpoints=len(out.checkpoints),
                        estimated_peak_mb=round(out.estimated_peak_bytes / 2**20, 3),
                        plain_peak_mb=round(out.plain_peak_bytes / 2**20, 3))
        elif variant.startswith("gradients"):
            info = dict(ops_after=len(graph.get_operations()))
        del graph, loss, ws, out
        print("  %-18s %6d blocks  %8.3f s" % (variant, blocks, seconds[-1]), file=log)
        if seconds[-1] > limit:
            break
    return seconds, info


def run(quick=False, out_dir=None, sizes=None, runs=3, limit=120.0, log=sys.stderr):
    """Run the benchmark; write rewrite_speed.{json,md}; return the result dict."""
    sizes = list(sizes or (QUICK_SIZES if quick else SIZES))
    start = time.perf_counter()
    fixed, per = ops_per_block()
    meta = machine_info()
    meta.update(mode="quick" if quick else "full", runs=runs, limit_s=limit,
                model="residual MLP, h <- h + relu(h @ W1) @ W2, batch %d x width %d"
                      % (BATCH, WIDTH),
                ops_per_block=per, fixed_ops=fixed)
    rows = []
    for target in sizes:
        blocks = blocks_for(target, fixed, per)
        t0 = time.perf_counter()
        shared = build_forward(blocks)
        build_s = time.perf_counter() - t0
        forward_ops = len(shared[0].get_operations())
        print("%d blocks: %d forward ops (built in %.2f s)" % (blocks, forward_ops, build_s),
              file=log)
        for variant in VARIANTS:
            seconds, info = time_variant(variant, blocks, runs, limit, shared, log=log)
            median = statistics.median(seconds)
            row = dict(target_ops=target, forward_ops=forward_ops, blocks=blocks,
                       forward_build_s=round(build_s, 3), variant=variant,
                       seconds=round(median, 3), runs=[round(t, 3) for t in seconds],
                       s_per_1k_ops=round(1000.0 * median / forward_ops, 4),
                       slow=len(seconds) < runs)
            row.update(info)
            rows.append(row)
        del shared
    for row in rows:
        base = [r for r in rows if r["variant"] == "tf.gradients"
                and r["target_ops"] == row["target_ops"]][0]
        row["vs_tf_gradients"] = round(row["seconds"] / base["seconds"], 2)
    growth = {}
    for variant in VARIANTS:
        pts = sorted((r["forward_ops"], r["seconds"]) for r in rows if r["variant"] == variant)
        growth[variant] = {
            "%d->%d" % (a[0], b[0]): round(math.log(b[1] / a[1]) / math.log(b[0] / a[0]), 2)
            for a, b in zip(pts, pts[1:]) if a[1] > 0 and b[1] > 0}
    meta["seconds"] = round(time.perf_counter() - start, 1)
    meta["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    result = dict(meta=meta, rows=rows, growth_exponent=growth)
    table = markdown(result)
    cli.write(out_dir or cli.RESULTS, "rewrite_speed", result, table)
    result["markdown"] = table
    return result


def markdown(result):
    lines = ["| forward ops | variant | seconds (median) | s per 1k ops | vs tf.gradients "
             "| checkpoints |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append("| %d | %s | %.3f%s | %.3f | %.2f× | %s |" % (
            r["forward_ops"], r["variant"], r["seconds"],
            " (1 run, > limit)" if r["slow"] else "", r["s_per_1k_ops"],
            r["vs_tf_gradients"], r.get("checkpoints", "—")))
    lines.append("")
    lines.append("Growth exponent of the time between sizes (1 = linear in ops): " + "; ".join(
        "%s %s" % (v, ", ".join("%s: %.2f" % kv for kv in g.items()))
        for v, g in result["growth_exponent"].items()))
    meta = result["meta"]
    lines.append("")
    lines.append("%s; %.1f ops per block. CPU (%s, %d cores), TensorFlow %s; median of %d "
                 "runs (a fresh forward graph for each tf.gradients / memsave.gradients run)." % (
                     meta["model"], meta["ops_per_block"], meta["processor"], meta["cpus"],
                     meta["tf_version"], meta["runs"]))
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = cli.parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="1k and 5k ops only")
    parser.add_argument("--sizes", type=int, nargs="*", help="target forward op counts")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--limit", type=float, default=120.0,
                        help="seconds after which a variant is not repeated")
    args = cli.parse(parser, argv)
    cli.report(run(quick=args.quick, out_dir=args.out, sizes=args.sizes, runs=args.runs,
                   limit=args.limit), "rewrite_speed", args.out)


if __name__ == "__main__":
    main()
