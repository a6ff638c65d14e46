"""Peak memory and step time on four model families, for memsave and its peers.

Run ``python -m benchmarks.models`` (about 3 minutes on 2 cores) or
``--quick`` (smaller inputs, fewer timed pairs; about a minute). Models,
written with raw TF ops and ``tf.Variable`` objects:

* ``unet``: a U-Net, 3 levels of two conv-BN-ReLU blocks down and up, with
  skip concatenations (every conv output is >= 1 MiB);
* ``densenet``: two dense blocks of BN-ReLU-conv3x3 layers, each layer
  concatenating its output to its input (DenseNet style), with a
  BN-ReLU-conv1x1 transition between them (every new feature map is 1 MiB);
* ``transformer``: 12 pre-LayerNorm encoder layers (multi-head
  self-attention + GELU MLP, residuals); the residual stream is 1 MiB;
* ``resnet``: a conv ResNet of basic blocks (conv-BN-ReLU-conv-BN + skip,
  ReLU) at a fixed resolution; every activation is 1 MiB.

For each model, every method computes the gradients of the loss with respect
to every weight:

* ``plain``: ``tf.gradients`` (compat.v1 Graph + Session);
* ``memory``, ``speed``, ``optimal``: ``memsave.gradients`` with that
  strategy (Session); 'memory' is reported as ``n/a: <reason>`` when it
  finds no single-tensor bottleneck;
* ``grappler``: ``tf.gradients`` in a Session whose Grappler memory optimizer
  is set to RECOMPUTATION_HEURISTICS;
* ``tf.recompute_grad``: blocks of ceil(sqrt(n)) consecutive layers wrapped
  in ``tf.recompute_grad``, inside a ``tf.function`` (n/a when the model is
  not a sequence of layers);
* ``plain tf.function``: a reference row, ``tf.GradientTape`` in a
  ``tf.function`` without recomputation (the baseline tf.recompute_grad
  runs against).

Reported per method: peak MiB (memsave.profile.peak_memory: allocator peak
above the pre-step baseline, BFC allocator, one inter-op thread, CPU), its
ratio to plain, the step-time ratio to plain (median over alternating
(plain, method) pairs, as in benchmarks.depth) and the seconds spent
building the gradient graph (``memsave.gradients`` for memsave, including
planning and rewriting; ``tf.gradients`` for plain and grappler), and for
the Session methods memsave.plan's estimate of the activation peak (made
separately, not timed). Plain's own time ratio (plain against itself) shows
the timing noise. Writes ``benchmarks/results/models.{json,md}``.
"""

import math
import os
import pathlib
import platform
import sys
import time
import traceback

from benchmarks import cli

cli.environment()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_inter_op_parallelism_threads(1)

import memsave  # noqa: E402
from memsave.profile import peak_memory, session_step  # noqa: E402
from benchmarks.depth import _grappler_config, recompute_grad_blocks, time_ratio  # noqa: E402

MIB = 2 ** 20
SESSION_METHODS = ("plain", "memory", "speed", "optimal", "grappler")
METHODS = SESSION_METHODS + ("tf.recompute_grad", "plain tf.function")
MODELS = ("unet", "densenet", "transformer", "resnet")

# Sizes per mode. 'full' is the default run, 'quick' is --quick, 'tiny' is
# for the tests (seconds per model).
SIZES = {
    "full": {
        "unet": dict(batch=16, size=64, channels=16, levels=3),
        "densenet": dict(batch=16, size=32, stem=32, growth=16, layers=6, blocks=2),
        "transformer": dict(batch=16, seq=128, dim=128, heads=4, layers=12),
        "resnet": dict(batch=8, size=32, channels=32, blocks=16),
    },
    "quick": {
        "unet": dict(batch=4, size=64, channels=16, levels=3),
        "densenet": dict(batch=4, size=32, stem=32, growth=16, layers=6, blocks=2),
        "transformer": dict(batch=4, seq=128, dim=128, heads=4, layers=12),
        "resnet": dict(batch=2, size=32, channels=32, blocks=16),
    },
    "tiny": {
        "unet": dict(batch=2, size=32, channels=8, levels=2),
        "densenet": dict(batch=2, size=16, stem=16, growth=8, layers=2, blocks=2),
        "transformer": dict(batch=2, seq=32, dim=32, heads=2, layers=4),
        "resnet": dict(batch=2, size=16, channels=16, blocks=4),
    },
}
REPEATS = {"full": 7, "quick": 3, "tiny": 1}


# ---------------------------------------------------------------------------
# Models. Each builder creates its variables in the current context (a Graph
# for Session methods, eagerly for tf.function ones) from a seeded RandomState
# and returns a Net. Sequence models give stem/body/head; the U-Net only
# gives forward.

class Net:
    def __init__(self, weights, x, stem=None, body=None, head=None, forward=None,
                 layer_bytes=None, note=""):
        self.weights, self.x = weights, x
        self.stem, self.body, self.head = stem, body, head
        self._forward = forward
        self.layer_bytes, self.note = layer_bytes, note

    def forward(self, x):
        if self._forward is not None:
            return self._forward(x)
        h = self.stem(x)
        for layer in self.body:
            h = layer(h)
        return self.head(h)


class _Vars:
    """Creates and collects the weights of one model."""

    def __init__(self, rng):
        self.rng, self.all = rng, []

    def _keep(self, value):
        v = tf.Variable(value.astype(np.float32))
        self.all.append(v)
        return v

    def conv(self, k, cin, cout):
        return self._keep(self.rng.randn(k, k, cin, cout) * math.sqrt(2.0 / (k * k * cin)))

    def dense(self, cin, cout, scale=1.0):
        return self._keep(self.rng.randn(cin, cout) * scale / math.sqrt(cin))

    def ones(self, n):
        return self._keep(np.ones(n))

    def zeros(self, n):
        return self._keep(np.zeros(n))

    def bn(self, c):
        return self.ones(c), self.zeros(c)


def _bn(h, scale_offset):
    scale, offset = scale_offset
    return tf.compat.v1.nn.fused_batch_norm(h, scale, offset, is_training=True)[0]


def _conv(h, w):
    return tf.nn.conv2d(h, w, 1, "SAME")


def _loss(out):
    return tf.reduce_mean(tf.square(out))


def build_unet(rng, c):
    """U-Net: ``levels`` x (conv-BN-ReLU, conv-BN-ReLU) down, max-pool, and up
    (2x nearest upsample, concat skip, conv-BN-ReLU x 2); 1x1 conv head."""
    v = _Vars(rng)
    batch, size, ch, levels = c["batch"], c["size"], c["channels"], c["levels"]
    x = rng.randn(batch, size, size, 3).astype(np.float32)
    down, up = [], []
    cin = 3
    for level in range(levels):
        cout = ch * 2 ** level
        down.append([(v.conv(3, cin, cout), v.bn(cout)), (v.conv(3, cout, cout), v.bn(cout))])
        cin = cout
    for level in reversed(range(levels)):
        skip = ch * 2 ** level
        up.append([(v.conv(3, cin + skip, skip), v.bn(skip)), (v.conv(3, skip, skip), v.bn(skip))])
        cin = skip
    w_out = v.conv(1, cin, 1)

    def block(h, convs):
        for w, bn in convs:
            h = tf.nn.relu(_bn(_conv(h, w), bn))
        return h

    def forward(x_):
        h, skips = x_, []
        for convs in down:
            h = block(h, convs)
            skips.append(h)
            h = tf.nn.max_pool2d(h, 2, 2, "VALID")
        for convs, skip in zip(up, reversed(skips)):
            h = tf.image.resize(h, skip.shape[1:3], method="nearest")
            h = block(tf.concat([h, skip], axis=-1), convs)
        return _loss(_conv(h, w_out))

    smallest = batch * (size // 2 ** (levels - 1)) ** 2 * ch * 2 ** (levels - 1) * 4
    return Net(v.all, x, forward=forward, layer_bytes=smallest,
               note="not a sequence of layers: each down level's output is concatenated "
                    "into the matching up level, so no run of consecutive layers has a "
                    "single input and output to wrap in ceil(sqrt(n)) blocks")


def build_densenet(rng, c):
    """Stem conv, then ``blocks`` dense blocks of ``layers`` layers
    (h <- concat(h, conv3x3(relu(bn(h))))), a BN-ReLU-conv1x1 transition
    halving the channels between blocks, and a pooled linear head."""
    v = _Vars(rng)
    batch, size, k = c["batch"], c["size"], c["growth"]
    x = rng.randn(batch, size, size, 3).astype(np.float32)
    w_stem = v.conv(3, 3, c["stem"])
    body = []
    cin = c["stem"]

    def dense_layer(bn, w):
        return lambda h: tf.concat([h, _conv(tf.nn.relu(_bn(h, bn)), w)], axis=-1)

    def transition(bn, w):
        return lambda h: _conv(tf.nn.relu(_bn(h, bn)), w)

    for b in range(c["blocks"]):
        for _ in range(c["layers"]):
            body.append(dense_layer(v.bn(cin), v.conv(3, cin, k)))
            cin += k
        if b + 1 < c["blocks"]:
            body.append(transition(v.bn(cin), v.conv(1, cin, cin // 2)))
            cin //= 2
    bn_out, w_head = v.bn(cin), v.dense(cin, 10)

    def head(h):
        h = tf.reduce_mean(tf.nn.relu(_bn(h, bn_out)), axis=[1, 2])
        return _loss(tf.matmul(h, w_head))

    return Net(v.all, x, stem=lambda x_: _conv(x_, w_stem), body=body, head=head,
               layer_bytes=batch * size * size * k * 4)


def build_transformer(rng, c):
    """An input projection, ``layers`` pre-LN encoder layers (multi-head
    self-attention, GELU MLP of width 4 * dim, residuals), a final LN."""
    v = _Vars(rng)
    batch, seq, dim, heads = c["batch"], c["seq"], c["dim"], c["heads"]
    dh = dim // heads
    x = rng.randn(batch, seq, dim).astype(np.float32)
    w_in = v.dense(dim, dim)

    def layer_norm(h, g, b):
        mean, var = tf.nn.moments(h, axes=[-1], keepdims=True)
        return (h - mean) * tf.math.rsqrt(var + 1e-5) * g + b

    def encoder_layer(p):
        def f(h):
            a = tf.reshape(layer_norm(h, p["g1"], p["b1"]), [batch * seq, dim])
            qkv = tf.reshape(tf.matmul(a, p["wqkv"]) + p["bqkv"], [batch, seq, 3, heads, dh])
            q, k, val = tf.unstack(tf.transpose(qkv, [2, 0, 3, 1, 4]))
            attn = tf.nn.softmax(tf.matmul(q, k, transpose_b=True) * (1.0 / math.sqrt(dh)))
            o = tf.reshape(tf.transpose(tf.matmul(attn, val), [0, 2, 1, 3]), [batch * seq, dim])
            h = h + tf.reshape(tf.matmul(o, p["wo"]) + p["bo"], [batch, seq, dim])
            a = tf.reshape(layer_norm(h, p["g2"], p["b2"]), [batch * seq, dim])
            m = tf.nn.gelu(tf.matmul(a, p["w1"]) + p["c1"])
            return h + tf.reshape(tf.matmul(m, p["w2"]) + p["c2"], [batch, seq, dim])
        return f

    body = []
    for _ in range(c["layers"]):
        p = dict(g1=v.ones(dim), b1=v.zeros(dim), wqkv=v.dense(dim, 3 * dim),
                 bqkv=v.zeros(3 * dim), wo=v.dense(dim, dim, 0.5), bo=v.zeros(dim),
                 g2=v.ones(dim), b2=v.zeros(dim), w1=v.dense(dim, 4 * dim),
                 c1=v.zeros(4 * dim), w2=v.dense(4 * dim, dim, 0.5), c2=v.zeros(dim))
        body.append(encoder_layer(p))
    g_out, b_out = v.ones(dim), v.zeros(dim)

    def stem(x_):
        return tf.reshape(tf.matmul(tf.reshape(x_, [batch * seq, dim]), w_in), [batch, seq, dim])

    return Net(v.all, x, stem=stem, body=body,
               head=lambda h: _loss(layer_norm(h, g_out, b_out)),
               layer_bytes=batch * seq * dim * 4)


def build_resnet(rng, c):
    """Stem conv-BN-ReLU, ``blocks`` basic blocks relu(h + bn(conv(relu(bn(conv(h)))))),
    a pooled linear head."""
    v = _Vars(rng)
    batch, size, ch = c["batch"], c["size"], c["channels"]
    x = rng.randn(batch, size, size, 3).astype(np.float32)
    w_stem, bn_stem = v.conv(3, 3, ch), v.bn(ch)

    def basic_block(w1, bn1, w2, bn2):
        def f(h):
            r = tf.nn.relu(_bn(_conv(h, w1), bn1))
            return tf.nn.relu(h + _bn(_conv(r, w2), bn2))
        return f

    body = [basic_block(v.conv(3, ch, ch), v.bn(ch), v.conv(3, ch, ch), v.bn(ch))
            for _ in range(c["blocks"])]
    w_head = v.dense(ch, 10)
    return Net(v.all, x, stem=lambda x_: tf.nn.relu(_bn(_conv(x_, w_stem), bn_stem)),
               body=body, head=lambda h: _loss(tf.matmul(tf.reduce_mean(h, [1, 2]), w_head)),
               layer_bytes=batch * size * size * ch * 4)


BUILDERS = {"unet": build_unet, "densenet": build_densenet,
            "transformer": build_transformer, "resnet": build_resnet}


# ---------------------------------------------------------------------------
# Steps

def _session_config(method):
    if method != "grappler":
        return None     # the eager context's config: one inter-op thread
    return _grappler_config()


def session_method(model, sizes, method):
    """(step, session, rewrite seconds, forward op count, estimated peak bytes)
    for a Session method. The estimate is memsave.plan's (activations only;
    for plain, its estimate of plain backprop), made before and not timed."""
    graph = tf.Graph()
    with graph.as_default():
        net = BUILDERS[model](np.random.RandomState(0), sizes)
        loss = net.forward(tf.constant(net.x))
        forward_ops = len(graph.get_operations())
        estimate = None
        if method == "plain":
            estimate = memsave.plan(loss, net.weights, checkpoints=[]).plain_peak_bytes
        elif method != "grappler":
            estimate = memsave.plan(loss, net.weights, checkpoints=method).estimated_peak_bytes
        start = time.perf_counter()
        if method in ("plain", "grappler"):
            grads = tf.gradients(loss, net.weights)
        else:
            grads = memsave.gradients(loss, net.weights, checkpoints=method)
        rewrite_s = time.perf_counter() - start
        sess = tf.compat.v1.Session(graph=graph, config=_session_config(method))
        sess.run(tf.compat.v1.global_variables_initializer())
    return session_step(sess, grads), sess, rewrite_s, forward_ops, estimate


def function_method(model, sizes, method):
    """(step, None) for 'tf.recompute_grad' or 'plain tf.function'; a str
    (the n/a reason) when tf.recompute_grad does not apply."""
    net = BUILDERS[model](np.random.RandomState(0), sizes)
    x = tf.constant(net.x)
    if method == "plain tf.function":
        forward = net.forward
    else:
        if net.body is None:
            return "n/a: " + net.note
        blocks = recompute_grad_blocks(net.body)

        def forward(x_):
            h = net.stem(x_)
            for b in blocks:
                h = b(h)
            return net.head(h)

    weights = net.weights

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = forward(x)
        return tape.gradient(loss, weights)
    return step


def recompute_blocks(net):
    if net.body is None:
        return None
    n = len(net.body)
    size = int(math.ceil(math.sqrt(n)))
    return dict(layers=n, block_size=size, blocks=int(math.ceil(n / size)))


def run_model(model, sizes, repeats, log=sys.stderr):
    """Rows (one per method) for one model."""
    base, base_sess, base_rewrite, forward_ops, base_estimate = session_method(
        model, sizes, "plain")
    base_peak = peak_memory(base)
    rows = []
    for method in METHODS:
        row = dict(model=model, method=method,
                   mode="session" if method in SESSION_METHODS else "tf.function",
                   peak_mb=None, peak_ratio=None, time_ratio=None, step_ms=None,
                   rewrite_s=None, estimated_peak_mb=None, na=None)
        sess, estimate = None, None
        try:
            if method == "plain":
                step, rewrite_s, peak, estimate = base, base_rewrite, base_peak, base_estimate
            elif method in SESSION_METHODS:
                step, sess, rewrite_s, _, estimate = session_method(model, sizes, method)
                peak = peak_memory(step)
            else:
                step, rewrite_s = function_method(model, sizes, method), None
                if isinstance(step, str):
                    row["na"] = step
                    rows.append(row)
                    print("%-11s %-18s %s" % (model, method, step), file=log)
                    continue
                peak = peak_memory(step)
            ratio, seconds = time_ratio(step, base, repeats)
        except memsave.NoBottleneckError as e:
            row["na"] = "n/a: %s" % e
            rows.append(row)
            print("%-11s %-18s %s" % (model, method, row["na"]), file=log)
            continue
        except Exception as e:  # pylint: disable=broad-except
            traceback.print_exc(file=log)
            row["na"] = "error: %s: %s" % (type(e).__name__, e)
            rows.append(row)
            continue
        finally:
            if sess is not None:
                sess.close()
        row.update(peak_mb=round(peak / MIB, 2), peak_ratio=round(peak / base_peak, 3),
                   time_ratio=round(ratio, 3), step_ms=round(seconds * 1e3, 1),
                   rewrite_s=None if rewrite_s is None else round(rewrite_s, 3),
                   estimated_peak_mb=None if estimate is None else round(estimate / MIB, 2))
        rows.append(row)
        print("%-11s %-18s peak %8.1f MiB (%.2f)  step %7.1f ms (%.2fx)  build %s s" % (
            model, method, peak / MIB, peak / base_peak, seconds * 1e3, ratio,
            "-" if rewrite_s is None else "%.2f" % rewrite_s), file=log)
    base_sess.close()
    by = {r["method"]: r for r in rows}
    rg, fn = by["tf.recompute_grad"], by["plain tf.function"]
    if rg["peak_mb"] and fn["peak_mb"]:
        # Against the tf.function baseline; the time figure divides two medians.
        rg["vs_plain_tf_function"] = dict(peak=round(rg["peak_mb"] / fn["peak_mb"], 3),
                                          time=round(rg["time_ratio"] / fn["time_ratio"], 3))
    return rows, forward_ops


def machine_info():
    cpu = ""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return dict(tf_version=tf.__version__, python=platform.python_version(),
                machine=platform.machine(), processor=platform.processor() or cpu,
                cpus=os.cpu_count(), platform=platform.platform(),
                load_average=[round(x, 2) for x in os.getloadavg()])


def _cell(value, fmt):
    return "—" if value is None else fmt % value


def markdown(result):
    lines = []
    meta = result["meta"]
    for model in result["models"]:
        info = result["models"][model]
        lines.append("**%s** (%s; %d forward ops; smallest layer activation %.2f MiB) — "
                     "peak above baseline, ratios to plain tf.gradients" % (
                         model, ", ".join("%s=%s" % kv for kv in info["sizes"].items()),
                         info["forward_ops"], info["layer_mb"]))
        lines.append("")
        lines.append("| method | peak MiB | peak vs plain | step time vs plain | step ms "
                     "| gradient build s | planner's estimate MiB |")
        lines.append("|---|---|---|---|---|---|---|")
        for r in result["rows"]:
            if r["model"] != model:
                continue
            if r["na"]:
                lines.append("| %s | %s | — | — | — | — | — |" % (r["method"], r["na"]))
                continue
            lines.append("| %s | %.1f | %.2f | %s | %.1f | %s | %s |" % (
                r["method"], r["peak_mb"], r["peak_ratio"],
                ("%.2f× (self)" if r["method"] == "plain" else "%.2f×") % r["time_ratio"],
                r["step_ms"], _cell(r["rewrite_s"], "%.2f"),
                _cell(r.get("estimated_peak_mb"), "%.1f")))
        for r in result["rows"]:
            if r["model"] == model and r.get("vs_plain_tf_function"):
                lines.append("")
                lines.append("tf.recompute_grad against plain tf.function: peak %.2f, "
                             "step time about %.2f× (ratio of the two median ratios)." % (
                                 r["vs_plain_tf_function"]["peak"],
                                 r["vs_plain_tf_function"]["time"]))
        lines.append("")
    lines.append("CPU (%s, %d cores), TensorFlow %s, %d timed pairs per ratio (%s run). "
                 "tf.recompute_grad and plain tf.function run in a tf.function; their "
                 "time ratios are also to the Session plain step." % (
                     meta["processor"] or meta["machine"], meta["cpus"], meta["tf_version"],
                     meta["repeats"], meta["mode"]))
    return "\n".join(lines) + "\n"


def run(quick=False, out_dir=None, tiny=False, models=MODELS, repeats=None, log=sys.stderr):
    """Run the benchmark; write models.{json,md} to ``out_dir``; return the result dict."""
    mode = "tiny" if tiny else "quick" if quick else "full"
    repeats = repeats or REPEATS[mode]
    start = time.perf_counter()
    meta = machine_info()
    meta.update(mode=mode, repeats=repeats,
                meter="allocator peak above pre-step baseline, BFC, 1 inter-op thread, CPU",
                time_ratio="median over alternating (plain, method) pairs after one warm-up "
                           "run of each",
                build_s="seconds in memsave.gradients (plan + rewrite) or tf.gradients")
    result = dict(meta=meta, models={}, rows=[])
    for model in models:
        sizes = SIZES[mode][model]
        rows, forward_ops = run_model(model, sizes, repeats, log=log)
        net = BUILDERS[model](np.random.RandomState(0), sizes)
        result["models"][model] = dict(sizes=sizes, forward_ops=forward_ops,
                                       layer_mb=round(net.layer_bytes / MIB, 3),
                                       weights=len(net.weights),
                                       recompute_grad=recompute_blocks(net),
                                       doc=BUILDERS[model].__doc__.split("\n")[0].strip())
        result["rows"].extend(rows)
    meta["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    meta["seconds"] = round(time.perf_counter() - start, 1)
    table = markdown(result)
    cli.write(out_dir or cli.RESULTS, "models", result, table)
    result["markdown"] = table
    return result


def main(argv=None):
    parser = cli.parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller inputs, 3 timed pairs")
    parser.add_argument("--tiny", action="store_true", help="tiny inputs, 1 timed pair (tests)")
    parser.add_argument("--models", nargs="*", choices=MODELS, default=list(MODELS))
    parser.add_argument("--repeats", type=int, help="timed pairs per method")
    args = cli.parse(parser, argv)
    cli.report(run(quick=args.quick, out_dir=args.out, tiny=args.tiny, models=args.models,
                   repeats=args.repeats), "models", args.out)


if __name__ == "__main__":
    main()
