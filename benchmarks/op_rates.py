"""How fast this CPU runs each kind of op, against the planner's cost model.

``python -m benchmarks.op_rates`` times ops the zoo's models recompute
(convolutions, matmuls, attention scores, elementwise chains, batch-norm and
layer-norm moments, softmax, GELU) at the zoo's shapes, each alone in a
``tf.function``, and sets each against its modeled work
(:func:`memsave.graph.region.op_cost`: FLOPs and bytes moved, each
at its op kind's rate, summed over the function's ops). The model's rates
come from this table: work per second is taken from the 3×3 convolution;
'measured / modeled' is then how much more (or less) an op costs than the
model says. ``max_recompute`` and a budget's "least time" rank plans by the
model, so an op kind far above 1 costs more step time than its plans were
estimated to.

The model's price per byte comes from the second table: the forward pass
of each zoo model (its step's recomputable work), timed and split into
FLOPs (matmuls and convolutions, one per element elsewhere) and bytes moved
by op kind, and a least-squares fit of the times to those parts
(relative error). Models with function calls are left out of the
fit and of the spread: ConvNeXtTiny's grouped convolutions run in
XLA-compiled calls, priced at their own rate (the first table's last row).
Its 'work per second' column, under the model's prices and under a flat
2.5 per byte, shows how well one rate fits all models.
Writes ``benchmarks/results/op_rates.{json,md}``. ``--quick``: small shapes,
two models.
"""

import statistics
import time

from benchmarks import cli

cli.environment()

REFERENCE = "conv 3x3"


def _cases(quick):
    """(name, function, input shapes) at the zoo's shapes (``quick``: an eighth)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    b, t = (4, 128) if quick else (32, 1024)
    image = [b, 32, 32, 256] if not quick else [b, 16, 16, 64]
    channels = image[-1]
    tokens = [2, t, 768 if not quick else 128]
    heads = [2, 12 if not quick else 2, t, 64]
    # ConvNeXtTiny's first grouped (depthwise) 7x7 convolution, compiled with
    # XLA as Keras compiles it on a CPU, whose kernels cannot group.
    grouped = [8, 32, 32, 96] if not quick else [4, 16, 16, 32]
    grouped_conv = tf.function(lambda x, w: tf.nn.conv2d(x, w, 1, "SAME"), jit_compile=True)
    return [
        (REFERENCE, lambda x, w: tf.nn.conv2d(x, w, 1, "SAME"),
         [image, [3, 3, channels, channels]]),
        ("conv 1x1", lambda x, w: tf.nn.conv2d(x, w, 1, "SAME"), [image, [1, 1, channels, channels]]),
        ("dense matmul", lambda x, w: tf.einsum("btd,de->bte", x, w), [tokens, tokens[-1:] * 2]),
        ("attention scores (batched matmul)", lambda q: tf.matmul(q, q, transpose_b=True), [heads]),
        ("bias add + relu", lambda x, c: tf.nn.relu(x + c), [image, [channels]]),
        ("scale and shift (mul, add)", lambda x, c: x * c + c, [image, [channels]]),
        ("batch-norm moments (mean, squared difference, mean)",
         lambda x: tf.nn.moments(x, [0, 1, 2]), [image]),
        ("layer-norm moments (last axis)", lambda x: tf.nn.moments(x, [-1], keepdims=True), [tokens]),
        ("softmax (last axis)", tf.nn.softmax, [heads[:3] + [t]]),
        ("GELU (tanh)", lambda x: tf.nn.gelu(x, approximate=True), [tokens[:2] + [4 * tokens[2]]]),
        ("grouped conv 7x7 (XLA-compiled)", grouped_conv, [grouped, [7, 7, 1, grouped[-1]]]),
    ]


def _modeled(concrete):
    """The cost model's work for every op of a traced function (its inputs,
    constants and output identities cost nothing there)."""
    from memsave.graph.region import op_cost  # pylint: disable=import-outside-toplevel
    return sum(op_cost(op) for op in concrete.graph.get_operations())


def _seconds(fn, args, repeats):
    """Median seconds of one call, over ``repeats`` timed calls after a warm-up."""
    fn(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn(*args)
        for t in (out if isinstance(out, (list, tuple)) else [out]):
            t.numpy()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


FIT_MODELS = ("ResNet50", "DenseNet121", "MobileNetV2", "EfficientNetB0", "ConvNeXtTiny",
              "GPT2", "BERT", "GPT2@1024", "BERT@1024", "GPT2@1024x768", "BERT@1024x768")
QUICK_FIT_MODELS = ("MobileNetV2", "GPT2")
PARTS = ("flops", "dense_bytes", "softmax_bytes", "other_bytes")
FLAT_BYTE_COST = 2.5


def _forward_parts(key, quick, repeats):
    """A zoo model's forward pass: its work split by kind (function calls'
    bodies included), how many calls, and the median seconds of one pass."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from benchmarks import zoo  # pylint: disable=import-outside-toplevel
    from memsave import tf_internal  # pylint: disable=import-outside-toplevel
    from memsave.graph import region  # pylint: disable=import-outside-toplevel
    batch, size = (zoo.QUICK_SIZES if quick else zoo.SIZES)[key]
    model, x, y, loss_fn = zoo._build(key, batch, size)  # pylint: disable=protected-access
    inputs = [tf.constant(a) for a in x] if isinstance(x, list) else tf.constant(x)
    labels = tf.constant(y)
    forward = tf.function(lambda: loss_fn(labels, model(inputs, training=True)))
    parts = dict.fromkeys(PARTS, 0.0)
    calls = 0
    for op in forward.get_concrete_function().graph.get_operations():
        calls += tf_internal.is_function_call(op)
        flops, moved = region.cost_parts(op)
        parts["flops"] += flops
        for kind, n in moved.items():
            parts[kind + "_bytes"] += n
    return dict(model=key, parts=parts, calls=calls,
                seconds=_seconds(forward, [], repeats))


def _work(parts, byte_cost):
    return parts["flops"] + sum(byte_cost[k] * parts[k + "_bytes"]
                                for k in ("dense", "softmax", "other"))


def fit_byte_cost(rows, softmax_ratio):
    """The price per byte (FLOP-equivalents) of ops other than matmuls and
    convolutions that best fits the models' times, softmax's held at
    ``softmax_ratio`` times it (alone, softmax's bytes barely vary between
    the models and cannot be fitted) and a matmul's or convolution's at
    :data:`FLAT_BYTE_COST`: least squares on relative error, non-negative."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    rows = [r for r in rows if not r["calls"]]
    seconds = np.array([r["seconds"] for r in rows])
    columns = np.array([[r["parts"]["flops"] + FLAT_BYTE_COST * r["parts"]["dense_bytes"],
                         r["parts"]["other_bytes"] + softmax_ratio * r["parts"]["softmax_bytes"]]
                        for r in rows]) / seconds[:, None]
    coef = np.linalg.lstsq(columns, np.ones(len(rows)), rcond=None)[0]
    return dict(other=max(float(coef[1] / coef[0]), 0.0) if coef[0] > 0 else None,
                softmax_ratio=softmax_ratio, models=[r["model"] for r in rows])


def run(quick=False, repeats=15):
    """Rows of op kind, modeled work, seconds, and measured against modeled;
    the zoo models' forward passes and the prices per byte fitted to them."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from memsave.graph.region import BYTE_COST  # pylint: disable=C0415
    tf.config.threading.set_inter_op_parallelism_threads(1)
    rng = tf.random.Generator.from_seed(0)
    rows = []
    for name, body, shapes in _cases(quick):
        args = [rng.normal(s) for s in shapes]
        fn = tf.function(body)
        rows.append(dict(op=name, shapes=shapes, modeled=_modeled(fn.get_concrete_function(*args)),
                         seconds=_seconds(fn, args, repeats)))
    reference = next(r for r in rows if r["op"] == REFERENCE)
    rate = reference["modeled"] / reference["seconds"]   # work per second
    for r in rows:
        r["measured_over_modeled"] = r["seconds"] * rate / r["modeled"]
    models = [_forward_parts(key, quick, 7) for key in (QUICK_FIT_MODELS if quick else FIT_MODELS)]
    flat = dict(dense=FLAT_BYTE_COST, softmax=FLAT_BYTE_COST, other=FLAT_BYTE_COST)
    for m in models:
        m["work_per_second"] = _work(m["parts"], BYTE_COST) / m["seconds"]
        m["flat_work_per_second"] = _work(m["parts"], flat) / m["seconds"]
    return dict(byte_cost=BYTE_COST, work_per_second=rate, rows=rows, models=models,
                fitted=fit_byte_cost(models, BYTE_COST["softmax"] / BYTE_COST["other"]))


def markdown(result):
    """The table: one row per op kind."""
    moved = result["byte_cost"]
    lines = ["Ops alone in a `tf.function` (float32, one inter-op thread), against the cost "
             "model (FLOP-equivalents: FLOPs plus, per byte moved, %g for a matmul or "
             "convolution, %g for softmax, %g for every other op); work per second from the "
             "3×3 convolution: %.0f G. 'measured / modeled': the op's time against what the "
             "model gives it at that rate (1: as modeled; above 1: it costs more step time "
             "than plans are estimated to)." % (
                 moved["dense"], moved["softmax"], moved["other"],
                 result["work_per_second"] / 1e9),
             "", "| op | shapes | modeled work (G) | ms | measured / modeled |",
             "|---|---|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append("| %s | %s | %.2f | %.2f | %.1f× |" % (
            r["op"], " · ".join("×".join(str(d) for d in s) for s in r["shapes"]),
            r["modeled"] / 1e9, 1e3 * r["seconds"], r["measured_over_modeled"]))
    fitted = result["fitted"]
    lines += ["", "The zoo's forward passes (float32, one inter-op thread; 'work per second': "
              "modeled work over measured time, with the model's prices and with %g per "
              "byte for every op; the closer a column's figures, the better one rate fits "
              "all models). The price per byte of ops other than matmuls and convolutions "
              "fitted to these times (models without function calls: %s; softmax's at "
              "%.1f times it): %s." % (
                  FLAT_BYTE_COST, ", ".join(fitted["models"]), fitted["softmax_ratio"],
                  "none fits" if fitted["other"] is None else "%.1f" % fitted["other"]),
              "", "| model | FLOPs (G) | bytes: matmul/conv, softmax, other (GB) | function calls "
              "| ms | work per second (G) | at %g per byte (G) |" % FLAT_BYTE_COST,
              "|---|---:|---|---:|---:|---:|---:|"]
    for m in result["models"]:
        p = m["parts"]
        lines.append("| %s | %.1f | %.2f, %.2f, %.2f | %d | %.1f | %.0f | %.0f |" % (
            m["model"], p["flops"] / 1e9, p["dense_bytes"] / 1e9, p["softmax_bytes"] / 1e9,
            p["other_bytes"] / 1e9, m["calls"], 1e3 * m["seconds"], m["work_per_second"] / 1e9,
            m["flat_work_per_second"] / 1e9))
    spread = [max(v) / min(v) for v in (
        [m["work_per_second"] for m in result["models"] if not m["calls"]],
        [m["flat_work_per_second"] for m in result["models"] if not m["calls"]])]
    lines += ["", "Work per second, fastest over slowest model without function calls: "
              "%.2f× with the model's prices, %.2f× at %g per byte." % (
                  spread[0], spread[1], FLAT_BYTE_COST)]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = cli.parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="small shapes")
    args = cli.parse(parser, argv)
    from benchmarks.models import machine_info  # pylint: disable=import-outside-toplevel
    result = run(quick=args.quick)
    result["machine"] = machine_info()
    text = markdown(result)
    cli.write(args.out, "op_rates_quick" if args.quick else "op_rates", result, text)
    print(text)
    return 0


if __name__ == "__main__":
    main()
