"""How fast this CPU runs each kind of op, against the planner's cost model.

``python -m benchmarks.op_rates`` times ops the zoo's models recompute
(convolutions, matmuls, attention scores, elementwise chains, batch-norm and
layer-norm moments, softmax, GELU) at the zoo's shapes, each alone in a
``tf.function``, and sets each against its modeled work
(:func:`memsave.graph.region.op_cost`: FLOPs plus
``FLOPS_PER_BYTE`` per byte moved, summed over the function's ops). Work
per second is taken from the 3×3 convolution; 'measured / modeled' is then
how much more (or less) an op costs than the model says. ``max_recompute``
and a budget's "least time" rank plans by the model, so an op kind far
above 1 costs more step time than its plans were estimated to.
Writes ``benchmarks/results/op_rates.{json,md}``. ``--quick``: small shapes.
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
    ]


def _modeled(concrete):
    """The cost model's work for every op of a traced function but its inputs and outputs."""
    from memsave.graph.region import op_cost  # pylint: disable=import-outside-toplevel
    skip = {"Placeholder", "Identity", "Const", "NoOp"}
    return sum(op_cost(op) for op in concrete.graph.get_operations() if op.type not in skip)


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


def run(quick=False, repeats=15):
    """Rows of op kind, modeled work, seconds, and measured against modeled."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from memsave.graph.region import FLOPS_PER_BYTE  # pylint: disable=C0415
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
    return dict(flops_per_byte=FLOPS_PER_BYTE, work_per_second=rate, rows=rows)


def markdown(result):
    """The table: one row per op kind."""
    lines = ["Ops alone in a `tf.function` (float32, one inter-op thread), against the cost "
             "model (FLOPs plus %.1f FLOP-equivalents per byte moved); work per second from "
             "the 3×3 convolution: %.0f G. 'measured / modeled': the op's time against what "
             "the model gives it at that rate (1: as modeled; above 1: it costs more step "
             "time than plans are estimated to)." % (result["flops_per_byte"],
                                                     result["work_per_second"] / 1e9),
             "", "| op | shapes | modeled work (G) | ms | measured / modeled |",
             "|---|---|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append("| %s | %s | %.2f | %.2f | %.1f× |" % (
            r["op"], " · ".join("×".join(str(d) for d in s) for s in r["shapes"]),
            r["modeled"] / 1e9, 1e3 * r["seconds"], r["measured_over_modeled"]))
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
