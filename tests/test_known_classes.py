"""Classes of wrong gradients and crashes found by differential testing.

Each class is a mechanism, checked under every strategy, with and without
offloading, against plain ``tf.gradients`` on the same graph:

- *segment hand-off* (float32, oneDNN on by default on AVX512 CPUs): a
  fusion of an op of one backward segment with an op of the next one
  (``_MklNativeConv2DBackpropFilterWithBias``: the BiasAddGrad of one
  segment and the Conv2DBackpropFilter of the next share their incoming
  gradient) made one node both before and after the next segment's
  recomputation: "N nodes in a cycle" or "Retval[0] does not have value".
- *waits on the ys* (float32, oneDNN on; found on MobileNetV3Small with
  'speed'): the first segment's copies waited for the ys themselves. In a
  step that returns only the gradients, Grappler pruned the forward tail
  behind the loss and handed the wait down to its inputs, a kept
  convolution among them; oneDNN then fused that convolution with the copy
  of its bias add, which waited for it: "N nodes in a cycle".
- *half-precision bias sums* (found by a helper trying to break memsave):
  a plan kept a bfloat16 convolution's output apart from its bias add.
  With oneDNN, plain backprop fuses the bias gradient into the
  convolution's filter gradient and sums it in float32; split across two
  segments, the bias gradient ran alone in TF's CPU kernel, which sums in
  bfloat16: 40-80% off plain's. Strategies now keep the bias add's output
  instead. Kept so, the segment starts at ``tf.gradients``' Identity of the
  incoming gradient, which waits for the segment before; Grappler removed
  it and put its wait on the BiasAddGrad, which oneDNN then did not fuse
  (0.04-0.09 off). That Identity is now kept from Grappler.
- *kept loops*: a loop that must not be recomputed (a stateful body, or a
  variable the step writes later) is differentiated in place; the gradient
  through its TensorList (``variant``) input was never asked for.
- *calls feeding kept ops* (found by the fuzzer): ``tf.gradients``
  differentiates a function call even when its output is a stop, so a call
  feeding an op kept in place (here a call reading a variable the step
  writes later) was differentiated twice.
- *xs made by calls in place* (found by a helper trying to break
  memsave): in a Graph, an x that a ``tf.function`` call makes (with
  another x above the call) read by a while loop, a cond or another call.
  That consumer is differentiated in place, and the call making the x with
  it, so the gradient arriving at the x went on through the call and was
  never asked for the x's own result: None (the audit refused it).
- *gated reads*: a copied ``Pow`` reads its input through a gate
  (an Identity that carries its control inputs); when that input was an
  offloaded checkpoint's swap-in, the swap-in's gradient was not asked for.
- *random without state* (found by a helper trying to break memsave):
  ``tf.nn.fractional_max_pool`` and ``fractional_avg_pool`` with
  ``seed=0`` pick new pooling windows at every run, yet TensorFlow declares
  them stateless; a copy pooled over other windows than the forward op
  (0.13-0.79 of the largest entry off plain's, or FractionalMaxPoolGrad's
  "tensor_out_dup is not the same as tensor_out"). With ``deterministic``
  set but no seed (``tf.compat.v1``), the windows are drawn once per node,
  and a copy is a new node. ``tf.image.extract_glimpse`` fills pixels
  outside the image with new noise at every run (0.26-1.3 off). They are
  pinned unless seeded, or with ``noise='zero'``.
- *inputs written in place* (found by a helper trying to break memsave):
  ``InplaceAdd`` (``inplace_ops.inplace_add``: a DeepCopy, then an add into
  that copy's buffer) is declared stateless; a copy added into the kept
  buffer a second time (0.25-0.62 off). Such ops are pinned.
- *feeds* (found by a helper trying to break memsave): in a Session, a
  fed tensor's value reaches plain's gradients, but a copy computed it
  again from its inputs: a learned initial RNN state fed with the last
  batch's gave gradients 0.06-0.31 of the largest entry off plain's.
  ``placeholder_with_default`` is never recomputed, and other tensors
  memsave recomputes cannot be fed (``Session.run`` raises).
- *reference variables written in place* (found by a helper trying to
  break memsave): a TF1 variable (``use_resource=False``) read by an op,
  then updated by an ``assign_add`` in the same run. The read (an Identity)
  shares the variable's buffer, so a copy of the op saw the new value: 0.36
  of the largest entry off plain's. So may what TensorFlow hands that
  buffer on to (``tf.identity``, a reshape, a full slice, a tile by ones,
  the ref an assign returns: 1.03). Such an op is never recomputed.
- *sparse rows* (found by a helper trying to break memsave): a gather
  recomputed in several segments gave its table one IndexedSlices part per
  segment, which memsave summed per index, where TensorFlow gives one row
  per lookup. The dense sum was the same, but Keras' Adam squares each row:
  an embedding model's weights 0.25 of their largest entry off plain's
  after four steps. A gather is now differentiated once, as in plain, and
  so is a sparse segment reduction asked for a sparse gradient (found by a
  helper: 24 rows for 6 ids, one Adam step 0.9 of its size off); a
  sparse gradient with an inf or NaN is NaN throughout, so that Keras'
  overflow check, which ORs the rows of one index, still sees it.
- *users' gradients* (found by a helper trying to break memsave): an op
  recomputed in several segments is differentiated in each, on part of its
  output gradient, and the parts' results are summed. A
  ``tf.custom_gradient`` that clips its output gradient is not linear in
  it: the gradients were up to 0.88 of the largest entry off plain's, with
  no error.
- *probes that build TensorFlow's caches* (found by a helper trying to
  break memsave): the estimate compiles an XLA-compiled call with its
  gradient ahead (``memsave.graph.compiled_calls``). TensorFlow caches a
  function's forward and backward functions the first time they are built,
  and the probe built them under ``tf.init_scope``, where tapes are paused:
  a ``tf.recompute_grad`` in the function, whose gradient runs a tape, got
  a backward of zeros, and the user's step and every later tape used it
  (all zeros, with no error). In a Session's graph the probe made its
  inputs in the user's graph (a random op: later draws changed). The probe
  now runs in a thread of its own.

Values are compared relative to the largest entry of all gradients:
float64 to 1e-9; the float32 hand-off cases (oneDNN fuses float32 only)
to 1e-5, oneDNN's rounding.
"""

import numpy as np
import pytest
import tensorflow as tf

import memsave
import memsave.keras
from memsave.graph import stateful
from memsave.planning import policies
from tests.helpers import assert_same_as_plain

STRATEGIES = ("list", "optimal", "memory", "speed")
OFFLOAD = (None, "auto")

# The float32 cases here are what oneDNN fuses: `make test` runs this module
# with oneDNN's fusions on and again with them off.
pytestmark = pytest.mark.both_onednn


def _worst(plain, ours):
    """max |plain - ours| over all gradients, relative to the largest entry."""
    assert [g is None for g in plain] == [g is None for g in ours]
    pairs = [(np.asarray(a, np.float64), np.asarray(b, np.float64))
             for a, b in zip(plain, ours) if a is not None]
    scale = max(float(np.abs(a).max()) for a, _ in pairs)
    return max(float(np.abs(a - b).max()) for a, b in pairs) / scale


def _ours(loss, xs, listed, strategy, offload):
    kwargs = {"min_checkpoint_size": 0}
    if offload:
        kwargs["offload"] = listed if strategy == "list" else offload
    checkpoints = listed if strategy == "list" else strategy
    try:
        return memsave.gradients(loss, xs, checkpoints=checkpoints, **kwargs)
    except memsave.NoBottleneckError:
        if strategy == "memory":
            return None   # 'memory' on a graph without a bottleneck: documented
        raise


def _in_session(case, strategy, offload):
    graph = tf.Graph()
    with graph.as_default():
        loss, xs, listed = case.forward(case.variables())
        ours = _ours(loss, xs, listed, strategy, offload)
        if ours is None:
            return 0.0
        plain = tf.gradients(loss, xs)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            return _worst(*sess.run([plain, ours]))


def _in_function(case, strategy, offload):
    """Both gradients in one trace: a stateful op (dropout) runs once for both."""
    vs = case.variables()

    @tf.function
    def step():
        loss, xs, listed = case.forward(vs)
        ours = _ours(loss, xs, listed, strategy, offload)
        if ours is None:
            return [], []
        return tf.gradients(loss, xs), ours

    plain, ours = step()
    return _worst(plain, ours) if plain else 0.0


RUNNERS = {"session": _in_session, "function": _in_function}


# ---------------------------------------------------------------- segment hand-off

class _Case:
    """Variables made once (outside any tf.function), a forward pass per graph."""

    def __init__(self, make_variables, forward):
        self.variables, self.forward = make_variables, forward


def _weights(seed, *shapes, dtype=np.float64):
    rng = np.random.RandomState(seed)
    return lambda: [tf.Variable((rng.randn(*s) / np.sqrt(s[-2] if len(s) > 1 else 10))
                                .astype(dtype)) for s in shapes]


def _conv_bias_relu(ws):
    """Keeps the second conv output: its BiasAddGrad (segment 1) and the
    Conv2DBackpropFilter of segment 2 read the same gradient."""
    x = tf.constant(np.random.RandomState(0).randn(2, 8, 8, 3).astype(np.float32))
    c1 = tf.nn.conv2d(x, ws[0], 1, "SAME")
    h1 = tf.nn.relu(tf.nn.bias_add(c1, ws[1]))
    c2 = tf.nn.conv2d(h1, ws[2], 1, "SAME")
    h2 = tf.nn.relu(tf.nn.bias_add(c2, ws[3]))
    return tf.reduce_sum(h2 * h2), ws, [c2]


CONV_BIAS = _Case(_weights(0, (3, 3, 3, 4), (4,), (3, 3, 4, 4), (4,), dtype=np.float32),
                  _conv_bias_relu)


@pytest.mark.parametrize("mode", sorted(RUNNERS))
@pytest.mark.parametrize("offload", OFFLOAD)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_conv_bias_segments_hand_off_without_a_cycle(strategy, offload, mode):
    assert RUNNERS[mode](CONV_BIAS, strategy, offload) <= 1e-5


def test_keep_op_types_example_runs_in_float32():
    """docs/strategies.md's ``keep_op_types("Conv2D", "MatMul")`` on a conv net."""
    graph = tf.Graph()
    with graph.as_default():
        loss, ws, _ = CONV_BIAS.forward(CONV_BIAS.variables())
        ours = memsave.gradients(loss, ws, min_checkpoint_size=0,
                                 checkpoints=policies.keep_op_types("Conv2D", "MatMul"))
        plain = tf.gradients(loss, ws)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            assert _worst(*sess.run([plain, ours])) <= 1e-5


# ---------------------------------------------------------------- a piece of an op as an x

def _split_piece_and_weight(ws):
    """xs: one piece of a split (the other piece is read on) and the weight
    before it. A segment recomputed the split for the other piece and read
    the first through the copy, so its gradient never reached the x that
    the piece is: the audit refused every strategy (found by a helper
    breaking memsave)."""
    w, v = ws
    h = tf.constant(np.random.RandomState(17).randn(4, 6))
    for _ in range(3):
        h = tf.tanh(h @ w)
    piece, other = tf.split(h, [3, 3], axis=1)
    h = tf.concat([piece, other], 1)
    for _ in range(3):
        h = tf.tanh(h @ v)
    return tf.reduce_sum(h ** 2), [piece, w], [h.op.inputs[0]]


SPLIT_PIECE = _Case(_weights(17, (6, 6), (6, 6)), _split_piece_and_weight)


@pytest.mark.parametrize("mode", sorted(RUNNERS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_x_that_is_one_output_of_a_recomputed_op_gets_its_gradient(strategy, mode):
    assert RUNNERS[mode](SPLIT_PIECE, strategy, None) <= 1e-12


def _split_piece_alone(ws):
    """xs: one piece of a split and a weight after it, nothing before the
    split: tf.gradients does not differentiate the split (it makes an x and
    reads nothing downstream of one), so the gradient an add sends to the
    other piece goes no further. The audit counted that edge as one memsave
    must carry and refused the rewrite (found by the fuzzer)."""
    u, v = ws
    h = tf.tanh(tf.constant(np.random.RandomState(18).randn(4, 6)))
    piece, other = tf.split(h, [3, 3], axis=1)
    rest = tf.tanh(tf.concat([piece, piece * 2.0], 1) @ u)
    h = other + rest
    for _ in range(3):
        h = tf.tanh(h @ v)
    return tf.reduce_sum(h ** 2), [piece, v], [rest]


SPLIT_PIECE_ALONE = _Case(_weights(18, (6, 3), (3, 3)), _split_piece_alone)


@pytest.mark.parametrize("mode", sorted(RUNNERS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_x_whose_op_is_not_differentiated_sends_nothing_through_its_other_outputs(
        strategy, mode):
    assert RUNNERS[mode](SPLIT_PIECE_ALONE, strategy, None) <= 1e-12


# ---------------------------------------------------------------- waits on the ys

def _kept_conv_then_bias(ws):
    """The second convolution's output is kept; its bias is reshaped on the way
    in (as Keras' Conv2D does), so the bias add's copy is not a first copy."""
    x = tf.constant(np.random.RandomState(16).randn(2, 8, 8, 3).astype(np.float32))
    h1 = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(x, ws[0], 1, "SAME"), ws[1]))
    c2 = tf.nn.conv2d(h1, ws[2], 1, "SAME")
    h2 = tf.nn.bias_add(c2, tf.squeeze(tf.reshape(ws[3], (1, -1))))
    return tf.reduce_sum(tf.nn.relu(h2) ** 2), ws, [c2]


KEPT_CONV = _Case(_weights(16, (3, 3, 3, 4), (4,), (3, 3, 4, 4), (4,), dtype=np.float32),
                  _kept_conv_then_bias)


def alone(case, strategy, offload, mode):
    """Like the runners above, but memsave's gradients come from a step that
    fetches nothing else (plain's, computed apart, would keep the forward
    pass alive)."""
    if mode == "function":
        vs = case.variables()
        plain = tf.function(lambda: tf.gradients(case.forward(vs)[0], vs))()
        ours = tf.function(lambda: _ours(*case.forward(vs), strategy, offload))()
    else:
        graph = tf.Graph()
        with graph.as_default():
            loss, xs, listed = case.forward(case.variables())
            ours, plain = _ours(loss, xs, listed, strategy, offload), tf.gradients(loss, xs)
            with tf.compat.v1.Session(graph=graph) as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                ours = sess.run(ours) if ours is not None else None
                plain = sess.run(plain)
    return 0.0 if ours is None else _worst(plain, ours)


@pytest.mark.parametrize("mode", ["session", "function"])
@pytest.mark.parametrize("offload", OFFLOAD)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_step_returning_only_gradients_runs(strategy, offload, mode):
    assert alone(KEPT_CONV, strategy, offload, mode) <= 1e-5


# ---------------------------------------------------------------- half-precision bias sums

def _conv_bias_bfloat16(ws):
    """Three bfloat16 convolution + bias add + relu layers (float32 weights
    cast, as under mixed_bfloat16): each bias gradient sums 2,048 values."""
    x = tf.constant(np.random.RandomState(5).randn(2, 32, 32, 4), tf.bfloat16)
    h = x
    for kernel, bias in zip(ws[::2], ws[1::2]):
        c = tf.nn.conv2d(h, tf.cast(kernel, tf.bfloat16), 1, "SAME")
        h = tf.nn.relu(tf.nn.bias_add(c, tf.cast(bias, tf.bfloat16)))
    return tf.reduce_sum(tf.square(tf.cast(h, tf.float32))), ws, []


BFLOAT16_BIAS = _Case(_weights(6, *[(3, 3, 4, 4), (4,)] * 3, dtype=np.float32),
                      _conv_bias_bfloat16)


@pytest.mark.parametrize("mode", sorted(RUNNERS))
@pytest.mark.parametrize("offload", OFFLOAD)
@pytest.mark.parametrize("strategy", STRATEGIES[1:])
def test_half_precision_bias_gradients_are_summed_as_plain_sums_them(strategy, offload, mode):
    # bfloat16 keeps 8 bits: its rounding is 4e-3; a bias sum in bfloat16 was 0.4-0.8 off.
    assert RUNNERS[mode](BFLOAT16_BIAS, strategy, offload) <= 1e-2


def _conv_bias_attention_bfloat16(ws):
    """A bfloat16 convolution + bias add + relu read by a self-attention and
    its residual (Conv2D -> Reshape -> MultiHeadAttention + residual under
    mixed_bfloat16): plans recompute the convolution in the attention's
    segment and in the residual's, and each summed a part of the bias
    gradient in bfloat16 (0.08 of the largest entry off plain's, oneDNN off;
    found by a helper breaking memsave)."""
    kernel, bias, wq, wk, wv, wo = (tf.cast(w, tf.bfloat16) for w in ws)
    x = tf.constant(np.random.RandomState(8).randn(8, 16, 16, 8), tf.bfloat16)
    h = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(x, kernel, 1, "SAME"), bias))
    s = tf.reshape(h, [8, 256, 16])
    scores = tf.matmul(s @ wq, s @ wk, transpose_b=True) / 16.0
    out = (tf.nn.softmax(scores) @ (s @ wv)) @ wo + s
    return tf.reduce_sum(tf.square(tf.cast(out, tf.float32))) * 100.0, ws, [s]


BFLOAT16_BIAS_ATTENTION = _Case(
    _weights(8, (3, 3, 8, 16), (16,), (16, 16), (16, 16), (16, 16), (16, 16), dtype=np.float32),
    _conv_bias_attention_bfloat16)


@pytest.mark.parametrize("mode", sorted(RUNNERS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_half_precision_bias_add_read_by_several_segments_is_differentiated_once(
        strategy, mode):
    assert RUNNERS[mode](BFLOAT16_BIAS_ATTENTION, strategy, None) <= 1e-2


def _conv_bias_batch_norm_bfloat16(ws):
    """A bfloat16 convolution + bias add + relu, then a convolution + bias add
    into a training batch norm. Keeping the first bias add's output, its
    segment starts at tf.gradients' Identity of the incoming gradient, which
    waits for the segment before; Grappler removed that Identity and moved
    its wait onto the BiasAddGrad reading it, and oneDNN did not fuse a
    BiasAddGrad with a control input: 0.04-0.06 of the largest entry off
    plain's under 'speed' (0.087 in the helper's case that found it)."""
    x = tf.constant(np.random.RandomState(7).randn(4, 8, 8, 3), tf.bfloat16)
    kernel1, bias1, kernel2, bias2 = ws
    h = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(x, kernel1, 1, "SAME"), bias1))
    h = tf.nn.bias_add(tf.nn.conv2d(h, kernel2, 1, "SAME"), bias2)
    normed, _, _ = tf.compat.v1.nn.fused_batch_norm(h, tf.ones([8]), tf.zeros([8]),
                                                     is_training=True)
    loss = (tf.reduce_sum(tf.square(tf.cast(normed, tf.float32)))
            + tf.reduce_sum(tf.cast(h, tf.float32)))
    return loss, ws, []


def _bfloat16_weights(seed, *shapes):
    rng = np.random.RandomState(seed)
    return lambda: [tf.Variable(tf.constant(0.3 * rng.randn(*s), tf.bfloat16)) for s in shapes]


BFLOAT16_BIAS_BN = _Case(_bfloat16_weights(7, (3, 3, 3, 8), (8,), (3, 3, 8, 8), (8,)),
                         _conv_bias_batch_norm_bfloat16)


@pytest.mark.parametrize("mode", sorted(RUNNERS))
@pytest.mark.parametrize("strategy", STRATEGIES[1:])
def test_a_half_precision_bias_gradient_where_its_segment_starts_is_fused_as_plain(
        strategy, mode):
    assert RUNNERS[mode](BFLOAT16_BIAS_BN, strategy, None) <= 1e-2


def test_a_half_precision_matmul_output_with_a_bias_is_kept_as_the_biased_sum():
    from memsave.graph.region import analyze, to_plan_graph  # pylint: disable=C0415
    for dtype, apart in ((tf.bfloat16, False), (tf.float32, True)):
        graph = tf.Graph()
        with graph.as_default():
            x = tf.ones([4, 8], dtype)
            w = tf.compat.v1.placeholder(dtype, [8, 8])
            b = tf.compat.v1.placeholder(dtype, [1, 8])
            product = tf.matmul(x, w)
            total = product + b           # as Keras adds a bias: a broadcast add
            loss = tf.reduce_sum(tf.cast(tf.tanh(total), tf.float32))
            plan_graph = to_plan_graph(analyze([loss], [w, b]))
        assert plan_graph.nodes[product.name]["candidate"] is apart
        assert plan_graph.nodes[total.name]["expensive"] is not apart


# ---------------------------------------------------------------- kept loops

def _map_fn_dropout(ws):
    """A stateful map_fn body; the skip keeps w0 connected without it."""
    w0, w1 = ws
    x = tf.constant(np.random.RandomState(1).randn(6, 8))
    h = tf.tanh(x @ w0)
    m = tf.map_fn(lambda r: tf.nn.dropout(r, 0.5), h) + h
    loss = tf.reduce_sum(tf.tanh(m @ w1) ** 2)
    return loss, [w0, w1], [h]


def _scan_then_write(ws):
    """A scan reads a variable that the step assigns afterwards: kept in place."""
    w0, w1 = ws
    x = tf.constant(np.random.RandomState(2).randn(6, 8))
    h = tf.tanh(x @ w0)
    m = tf.scan(lambda a, r: a * 0.5 + r * w1[0], h) + h
    loss = tf.reduce_sum(tf.tanh(m @ w1) ** 2)
    with tf.control_dependencies([loss]):
        write = w1.assign_add(tf.ones_like(w1) * 0.1)
    tf.compat.v1.add_to_collection("updates", write)
    return loss, [w0, w1], [h]


def _tensor_array_print(ws):
    """A TensorArray loop with a tf.print in its body (stateful, not random)."""
    w0, = ws
    x = tf.constant(np.random.RandomState(3).randn(6, 8))
    h = tf.tanh(x @ w0)
    g = tf.sin(h)

    def body(i, ta):
        tf.print(i, output_stream="file:///dev/null")
        return i + 1, ta.write(i, g[i] * 2.0)

    _, ta = tf.while_loop(lambda i, ta: i < 6, body,
                          [tf.constant(0), tf.TensorArray(tf.float64, size=6)])
    loss = tf.reduce_sum(tf.tanh(ta.stack() + h) ** 2)
    return loss, [w0], [h]


KEPT_LOOPS = {"map_fn_dropout": _Case(_weights(1, (8, 8), (8, 8)), _map_fn_dropout),
              "scan_then_write": _Case(_weights(2, (8, 8), (8, 8)), _scan_then_write),
              "tensor_array_print": _Case(_weights(3, (8, 8)), _tensor_array_print)}


# ---------------------------------------------------------------- calls feeding kept ops

_NESTED = {}


def _kept_calls(ws):
    """Two nested calls reading w0, which the step assigns afterwards: both kept."""
    if "f" not in _NESTED:
        _NESTED["f"] = tf.function(lambda h, w: tf.tanh(h @ w) * 1.5)
    f = _NESTED["f"]
    w0, w1 = ws
    x = tf.constant(np.random.RandomState(8).randn(6, 8))
    h = tf.tanh(x @ w1)
    out = f(f(tf.sin(h), w0), w0) + h
    loss = tf.reduce_sum(tf.tanh(out @ w1) ** 2)
    with tf.control_dependencies([loss]):
        write = w0.assign_add(tf.ones_like(w0) * 0.1)
    tf.compat.v1.add_to_collection("updates", write)
    return loss, [w0, w1], [h]


KEPT_CALLS = _Case(_weights(8, (8, 8), (8, 8)), _kept_calls)


# ---------------------------------------------------------------- gated reads

def _pow_reads_offloaded(ws):
    """The copied Pow (gated) is the only reader of the offloaded checkpoint c."""
    w0, w1 = ws
    x = tf.constant(np.random.RandomState(4).randn(6, 8))
    h = tf.tanh(x @ w0)
    c = h @ w1
    loss = tf.reduce_sum(tf.tanh(c ** 2 + h))
    return loss, [w0, w1], [c]


POW_READS_OFFLOADED = _Case(_weights(4, (8, 8), (8, 8)), _pow_reads_offloaded)


# ---------------------------------------------------------------- random without state

def _fractional_pool(pool, in_call):
    """A fractional pool with seed=0 between einsums (in a function call with
    ``in_call``); the listed checkpoint is above it, so a plan that copied
    it would pool over new windows."""
    def forward(ws):
        w0, w1, w2 = ws
        x = tf.constant(np.random.RandomState(13).randn(4, 8, 8, 3))
        h = tf.tanh(tf.einsum("bhwc,cd->bhwd", x, w0))

        def pooled(t):
            return pool(tf.sin(t), [1.0, 1.5, 1.5, 1.0], pseudo_random=True)[0]
        p = tf.function(pooled)(h) if in_call else pooled(h)
        q = tf.tanh(tf.einsum("bhwc,cd->bhwd", p, w1))
        return tf.reduce_sum(tf.tanh(tf.einsum("bhwc,cd->bhwd", q, w2)) ** 2), ws, [q]
    return _Case(_weights(13, (3, 4), (4, 4), (4, 4)), forward)


def _unseeded(pool):
    """``tf.compat.v1``'s pool with ``deterministic=True`` and no seed."""
    return lambda t, ratio, pseudo_random: pool(t, ratio, pseudo_random=pseudo_random,
                                                deterministic=True)


def _glimpse(noise):
    """Glimpses (float32 only; no gradient) partly outside the image, between einsums."""
    def forward(ws):
        w0, w1, w2 = ws
        x = tf.constant(np.random.RandomState(15).randn(2, 4, 4, 3))
        h = tf.tanh(tf.einsum("bhwc,cd->bhwd", x, w0))
        g = tf.stop_gradient(tf.image.extract_glimpse(
            tf.cast(tf.sin(h), tf.float32), [3, 3], [[0.9, 0.9], [-0.9, 0.5]], noise=noise))
        q = tf.tanh(tf.einsum("bhwc,cd->bhwd", tf.cast(g, tf.float64), w1) + h[:, :3, :3])
        return tf.reduce_sum(tf.tanh(tf.einsum("bhwc,cd->bhwd", q, w2)) ** 2), ws, [q]
    return _Case(_weights(15, (3, 4), (4, 4), (4, 4)), forward)


RANDOM_WITHOUT_STATE = {
    "%s%s" % (name, "_in_call" if in_call else ""): _fractional_pool(pool, in_call)
    for name, pool in (("fractional_max_pool", tf.nn.fractional_max_pool),
                       ("fractional_avg_pool", tf.nn.fractional_avg_pool),
                       ("unseeded_deterministic_max_pool",
                        _unseeded(tf.compat.v1.nn.fractional_max_pool)))
    for in_call in (False, True)}
RANDOM_WITHOUT_STATE.update(glimpse_uniform=_glimpse("uniform"),
                            glimpse_gaussian=_glimpse("gaussian"))


def _input_written_in_place(ws):
    """``inplace_add`` on a copy of a recomputable tensor, read below the
    listed checkpoint (InplaceAdd has no gradient: behind a stop). 'memory'
    and 'speed' keep the copy the add writes into and recompute the add."""
    w0, w1, w2 = ws
    x = tf.constant(np.random.RandomState(16).randn(4, 8))
    h = tf.tanh(x @ w0)
    added = tf.raw_ops.InplaceAdd(x=tf.raw_ops.DeepCopy(x=h), i=[0, 2],
                                  v=tf.fill([2, 8], tf.constant(0.5, tf.float64)))
    q = tf.tanh(h @ w1) * tf.stop_gradient(added)
    return tf.reduce_sum(tf.tanh(q @ w2) ** 2), ws, [q]


INPUT_WRITTEN_IN_PLACE = _Case(_weights(16, (8, 8), (8, 8), (8, 8)), _input_written_in_place)


def test_a_seeded_fractional_pool_is_still_recomputed():
    """A nonzero seed makes the pool deterministic, and a glimpse without noise
    is: they cost no pinned memory."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.constant(np.random.RandomState(14).randn(2, 8, 8, 3))
        seeded = tf.nn.fractional_avg_pool(tf.sin(x), [1.0, 1.5, 1.5, 1.0], seed=7)[0]
        unseeded = tf.nn.fractional_avg_pool(tf.sin(x), [1.0, 1.5, 1.5, 1.0])[0]
        zero = tf.image.extract_glimpse(tf.cast(x, tf.float32), [3, 3], [[0.9, 0.9]] * 2,
                                        noise="zero")
    assert not stateful.is_pinned(seeded.op)
    assert not stateful.is_pinned(zero.op)
    assert stateful.is_pinned(unseeded.op)


# ---------------------------------------------------------------- feeds

def _carried_state(feedable):
    """A chain of tanh layers from a learned initial state, which a TF1 user
    feeds with the previous batch's (through placeholder_with_default when
    ``feedable``). Returns (state, layers, loss, xs)."""
    rng = np.random.RandomState(15)
    x = tf.constant(rng.randn(4, 8))
    ws = [tf.Variable(rng.randn(8, 8) / 3) for _ in range(5)]
    h0 = tf.Variable(rng.randn(8) * 0.1)
    state = tf.tanh(tf.tile(h0[None], [4, 1]))
    if feedable:
        state = tf.compat.v1.placeholder_with_default(state, [4, 8])
    h, layers = state, []
    for w in ws:
        h = tf.tanh(h @ w + x)
        layers.append(h)
    return state, layers, tf.reduce_sum(h ** 2), ws + [h0]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_fed_placeholder_with_default_reaches_the_gradients(strategy):
    graph = tf.Graph()
    with graph.as_default():
        state, layers, loss, xs = _carried_state(feedable=True)
        ours = _ours(loss, xs, [layers[2]], strategy, None)
        plain = tf.gradients(loss, xs)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = {state: np.random.RandomState(16).randn(4, 8)}
            if ours is not None:
                assert _worst(*sess.run([plain, ours], feed)) <= 1e-12


def test_a_recomputed_tensor_cannot_be_fed():
    graph = tf.Graph()
    with graph.as_default():
        state, layers, loss, xs = _carried_state(feedable=False)
        ours = memsave.gradients(loss, xs, checkpoints=[layers[2]])
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            with pytest.raises(ValueError, match="may not be fed"):
                sess.run(ours, {state: np.random.RandomState(16).randn(4, 8)})
            sess.run(ours)   # unfed, it runs


# ---------------------------------------------------------------- reference variables written in place

# How the forward pass reads the variable: each may hand on its buffer (a
# full slice and a tile by ones do, when they run; an assign returns the
# variable's ref).
REF_READS = {"read": lambda s: s, "identity": tf.identity,
             "reshape": lambda s: tf.reshape(tf.identity(s), [1, 16]),
             "slice": lambda s: s[0:16], "tile": lambda s: tf.tile(s, [1]),
             "assign": lambda s: tf.identity(tf.compat.v1.assign(
                 s, tf.fill([16], tf.constant(0.3, tf.float64))))}


def written_in_place(read="read"):
    """A graph whose forward pass reads a TF1 reference variable ``s`` (through
    ``REF_READS[read]``), then adds one to it in place, then goes on.
    Returns (graph, loss, weights)."""
    graph = tf.Graph()
    with graph.as_default():
        rng = np.random.RandomState(17)

        def variable(*shape):
            return tf.compat.v1.Variable(rng.randn(*shape) * 0.5, use_resource=False)
        ws = [variable(8, 16), variable(16, 16), variable(16, 16), variable(16, 4)]
        s = variable(16)
        h1 = tf.tanh(tf.constant(rng.randn(4, 8)) @ ws[0] + REF_READS[read](s))
        with tf.control_dependencies([h1]):
            update = tf.compat.v1.assign_add(s, tf.ones([16], tf.float64))
        with tf.control_dependencies([update]):
            h2 = tf.tanh(h1 @ ws[1])
        loss = tf.reduce_sum((tf.nn.relu(h2 @ ws[2]) @ ws[3]) ** 2)
    return graph, loss, ws


@pytest.mark.parametrize("read", sorted(REF_READS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_reference_variable_written_in_place_is_not_read_again(strategy, read):
    """Also where the read goes on through an identity, a reshape, a full
    slice or a tile by ones, or reads the ref an assign returns (found by
    helpers: ``tf.identity(v)`` after an assign, 1.03 of the largest entry
    off plain's; a full slice, 1.03), which all share the variable's buffer."""
    graph, loss, ws = written_in_place(read)
    with graph.as_default():
        ours = _ours(loss, ws, [loss.op.inputs[0]], strategy, None)   # 'list': the top
        plain = tf.gradients(loss, ws)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            got = sess.run([plain, ours]) if ours is not None else None
    if got is not None:
        assert _worst(*got) <= 1e-12


def _written_later(strategy, later):
    """Gradients (plain's, memsave's) of a graph that reads a TF1 reference
    variable ``st`` into an Add (whose gradient reads nothing) and, with
    ``later``, overwrites ``st`` in place by an assign made after the
    gradients and fetched in the same run (as an optimizer's apply is)."""
    out = []
    for ours in (False, True):
        graph = tf.Graph()
        with graph.as_default():
            w = tf.compat.v1.Variable(np.linspace(-1, 1, 16).reshape(4, 4))
            st = tf.compat.v1.Variable(np.ones((2, 4)), use_resource=False, trainable=False)
            h = tf.tanh(tf.constant(np.linspace(0.1, 0.9, 8).reshape(2, 4)) @ w)
            h = tf.tanh(tf.tanh(h + tf.identity(st)) @ w)
            h = tf.tanh(tf.tanh(h) @ w)
            loss = tf.reduce_sum(tf.tanh(h @ w) ** 2)
            grads = (memsave.gradients(loss, [w], checkpoints=strategy, fallback=False,
                                       min_checkpoint_size=0) if ours
                     else tf.gradients(loss, [w]))
            with tf.control_dependencies([h]):
                write = (tf.compat.v1.assign(st, tf.fill([2, 4], tf.constant(-100.0, tf.float64)))
                         if later else tf.no_op())
            with tf.compat.v1.Session(graph=graph) as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                out.append(sess.run([grads, write])[0])
    return out


@pytest.mark.parametrize("strategy", ["optimal", "memory", "speed"])
def test_a_reference_variable_written_after_the_gradients_is_not_read_again(strategy):
    """The writer need not exist when the gradients are built (found by a
    helper: 0.45 of the largest entry off plain's; an optimizer's apply on a
    weight also read behind a stop_gradient moved weights 0.85-1.9 off)."""
    plain, ours = _written_later(strategy, later=True)
    assert _worst(plain, ours) <= 1e-12
    assert _worst(*_written_later(strategy, later=False)) <= 1e-12


@pytest.mark.parametrize("strategy", ["optimal", "memory", "speed"])
def test_a_kept_tensor_written_in_place_is_not_read_again(strategy):
    """``InplaceUpdate`` (declared stateless) overwrites a matmul output that
    'speed' kept; the Add reading it was recomputed after the write (found
    by a helper: 0.69 of the largest entry off plain's)."""
    got = []
    for ours in (False, True):
        graph = tf.Graph()
        with graph.as_default():
            w = tf.compat.v1.Variable(np.linspace(-1, 1, 16).reshape(4, 4))
            h0 = tf.tanh(tf.constant(np.linspace(0.1, 0.9, 8).reshape(2, 4)) @ w)
            t = h0 @ w
            h = tf.tanh(tf.tanh(tf.tanh(h0 + t) @ w) @ w)
            with tf.control_dependencies([h]):
                write = tf.raw_ops.InplaceUpdate(
                    x=t, i=[0, 1], v=tf.fill([2, 4], tf.constant(-100.0, tf.float64)))
            with tf.control_dependencies([write]):
                loss = tf.reduce_sum(tf.tanh(h @ w) ** 2)
            grads = (memsave.gradients(loss, [w], checkpoints=strategy, fallback=False,
                                       min_checkpoint_size=0) if ours
                     else tf.gradients(loss, [w]))
            with tf.compat.v1.Session(graph=graph) as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                got.append(sess.run(grads))
    assert _worst(*got) <= 1e-12


# ---------------------------------------------------------------- users' gradients

@tf.custom_gradient
def _clipped(x):
    """The identity, whose gradient clips its output gradient's norm."""
    return tf.identity(x), lambda dy: tf.clip_by_norm(dy, 0.01)


@tf.custom_gradient
def _mixed(a, b):
    """Two outputs whose gradient mixes their output gradients nonlinearly."""
    def grad(da, db):
        both = tf.clip_by_norm(da + db, 0.05) + da * db
        return both, both
    return (tf.identity(a), tf.identity(b)), grad


def _clipped_twice_read(ws):
    """The clipped tensor feeds the listed checkpoint and the loss directly."""
    w, = ws
    h = tf.tanh(tf.constant(np.random.RandomState(13).randn(8, 16)) @ w)
    c = _clipped(h)
    near = tf.tanh(c @ w)
    return tf.reduce_sum(tf.tanh(near @ w) * c), [w], [near]


def _mixed_outputs_apart(ws):
    """Each output of a two-output custom gradient feeds its own branch."""
    w0, w1, w2 = ws
    h = tf.tanh(tf.constant(np.random.RandomState(14).randn(8, 16)) @ w0)
    a, b = _mixed(h, tf.sin(h))
    left = tf.tanh(tf.tanh(a @ w1) @ w1)
    right = tf.tanh(tf.tanh(b @ w2) @ w2)
    return tf.reduce_sum(left ** 2) + tf.reduce_sum(right), ws, [left]


_CALLS = {}


def _clipped_in_a_call(ws):
    """The clipped gradient inside a function call with two outputs read apart."""
    if "f" not in _CALLS:
        _CALLS["f"] = tf.function(lambda h: (_clipped(h) * 2.0, tf.sin(_clipped(h))))
    w0, w1 = ws
    h = tf.tanh(tf.constant(np.random.RandomState(15).randn(8, 16)) @ w0)
    p, q = _CALLS["f"](h)
    left = tf.tanh(tf.tanh(p @ w1) @ w1)
    return tf.reduce_sum(left ** 2) + tf.reduce_sum(tf.tanh(q @ w1)), ws, [left]


USERS_GRADIENTS = {
    "clipped_and_read_twice": _Case(_weights(13, (16, 16)), _clipped_twice_read),
    "two_outputs_read_apart": _Case(_weights(14, (16, 16), (16, 16), (16, 16)),
                                    _mixed_outputs_apart),
    "clipped_in_a_call": _Case(_weights(15, (16, 16), (16, 16)), _clipped_in_a_call)}


def test_the_audit_catches_a_users_gradient_run_on_parts(monkeypatch):
    """Without keeping the clipped tensor, the audit refuses the rewrite."""
    from memsave import rewrite   # pylint: disable=import-outside-toplevel
    monkeypatch.setattr(rewrite, "differentiated_once", lambda region, kept: list(kept))
    graph = tf.Graph()
    with graph.as_default():
        loss, xs, listed = USERS_GRADIENTS["clipped_and_read_twice"].forward(
            USERS_GRADIENTS["clipped_and_read_twice"].variables())
        with pytest.raises(memsave.GradientMismatchError, match="runs a gradient a user wrote"):
            memsave.gradients(loss, xs, checkpoints=listed)


# Each mechanism's float64 case: plain's gradients to 1e-9 of the largest entry.
MECHANISMS = {**{"kept_loop/" + k: v for k, v in KEPT_LOOPS.items()},
              **{"random_without_state/" + k: v for k, v in RANDOM_WITHOUT_STATE.items()},
              **{"users_gradient/" + k: v for k, v in USERS_GRADIENTS.items()},
              "call_feeding_a_kept_op": KEPT_CALLS,
              "input_written_in_place": INPUT_WRITTEN_IN_PLACE,
              "gated_read_of_an_offloaded_checkpoint": POW_READS_OFFLOADED}


@pytest.mark.parametrize("mode", sorted(RUNNERS))
@pytest.mark.parametrize("offload", OFFLOAD)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", sorted(MECHANISMS))
def test_mechanism_gives_plain_gradients(case, strategy, offload, mode):
    assert RUNNERS[mode](MECHANISMS[case], strategy, offload) <= 1e-9


@pytest.mark.parametrize("offload", OFFLOAD)
@pytest.mark.parametrize("checkpoints", ["optimal", "speed", "memory"])
def test_gradient_penalty_through_an_offloading_tape(checkpoints, offload):
    """A gradient penalty (the inner gradient on a plain tape, differentiated
    again by memsave's), with and without ``offload='auto'``."""
    rng = np.random.RandomState(5)
    ws = [tf.Variable(rng.randn(8, 8) / 3) for _ in range(3)]
    x = tf.constant(rng.randn(6, 8))

    def step(make_tape):
        with make_tape() as outer:
            with tf.GradientTape() as inner:
                inner.watch(x)
                h = x
                for w in ws:
                    h = tf.tanh(h @ w) ** 2
                out = tf.reduce_sum(h)
            gx = inner.gradient(out, x)
            loss = out + tf.reduce_sum(gx ** 2)
        return outer.gradient(loss, ws)

    @tf.function
    def both():
        ours = step(lambda: memsave.GradientTape(checkpoints=checkpoints, offload=offload,
                                                 min_checkpoint_size=0))
        return step(tf.GradientTape), ours

    try:
        plain, ours = both()
    except memsave.NoBottleneckError:
        assert checkpoints == "memory"
        return
    assert _worst(plain, ours) <= 1e-9


# ---------------------------------------------------------------- the same, through Keras fit

def _keras_fit(build, checkpoints, dtype="float32", policy=None, samples=8, batch=4, **options):
    """The gradients of one epoch of ``fit``, summed per weight (plain if not checkpoints).

    Layers compute in ``dtype``, or under the Keras dtype ``policy`` if given."""
    keras = pytest.importorskip("keras")
    from benchmarks.zoo_models import dtype_scope   # pylint: disable=import-outside-toplevel
    from tests.keras_helpers import GradientSum     # pylint: disable=import-outside-toplevel
    with dtype_scope(dtype):
        if policy:
            keras.config.set_dtype_policy(policy)
        keras.utils.set_random_seed(7)
        model, x, y = build(keras, samples)
        model.compile(optimizer=GradientSum(), loss="mse", jit_compile=False)
        if checkpoints:
            memsave.keras.enable(model, checkpoints, min_checkpoint_size=0, **options)
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
        model.fit(data, epochs=1, shuffle=False, verbose=0)
        return [v.numpy() for v in model.optimizer.sums]


def _conv_bn(keras, samples):
    rng = np.random.RandomState(0)
    inputs = keras.Input((12, 12, 3))
    h = inputs
    for width in (8, 8, 8):
        h = keras.layers.Conv2D(width, 3, padding="same")(h)
        h = keras.layers.BatchNormalization()(h)
        h = keras.layers.Activation("relu")(h)
    out = keras.layers.Dense(1)(keras.layers.GlobalAveragePooling2D()(h))
    x = rng.randn(samples, 12, 12, 3).astype(keras.config.floatx())
    return keras.Model(inputs, out), x, rng.randn(samples, 1).astype(keras.config.floatx())


def _rnn_dropout_cell(skip):
    def build(keras, samples):
        class Cell(keras.layers.Layer):
            """A GRU-less cell: tanh(x W + h U) with Dropout applied in call()."""

            state_size = 8

            def build(self, input_shape):
                self.w = self.add_weight(shape=(input_shape[-1], 8), name="w")
                self.u = self.add_weight(shape=(8, 8), name="u")
                self.drop = keras.layers.Dropout(0.3, seed=3)

            def call(self, x, states, training=False):
                h = tf.tanh(x @ self.w + states[0] @ self.u)
                h = self.drop(h, training=training)
                return h, [h]

        rng = np.random.RandomState(1)
        inputs = keras.Input((5, 4))
        h = keras.layers.Dense(4, activation="tanh")(inputs)
        seq = keras.layers.RNN(Cell(), return_sequences=True)(h)
        if skip:
            seq = keras.layers.Concatenate()([seq, h])
        out = keras.layers.Dense(1)(keras.layers.Flatten()(seq))
        x = rng.randn(samples, 5, 4).astype(keras.config.floatx())
        return keras.Model(inputs, out), x, rng.randn(samples, 1).astype(keras.config.floatx())
    return build


KERAS_STRATEGIES = ("optimal", "memory", "speed")   # what fit takes (no tensor lists)


def _keras_or_no_bottleneck(build, checkpoints, **kwargs):
    try:
        return _keras_fit(build, checkpoints, **kwargs)
    except memsave.NoBottleneckError:
        assert checkpoints == "memory"   # documented, on graphs without a bottleneck
        return None


@pytest.mark.heavy
@pytest.mark.parametrize("offload", OFFLOAD)
@pytest.mark.parametrize("checkpoints", KERAS_STRATEGIES)
def test_keras_conv_bn_fit_float32(checkpoints, offload):
    """Conv + BatchNormalization in float32, where oneDNN fuses."""
    plain = _keras_fit(_conv_bn, None)
    ours = _keras_or_no_bottleneck(_conv_bn, checkpoints, offload=offload)
    if ours is not None:
        assert _worst(plain, ours) <= 1e-4   # float32, and batch norm over 4 x 12 x 12


@pytest.mark.heavy
@pytest.mark.parametrize("checkpoints", KERAS_STRATEGIES)
def test_keras_conv_bn_mixed_bfloat16_with_offload(checkpoints):
    """``mixed_bfloat16`` Conv + BN with ``offload='auto'`` runs, and agrees with
    plain fit to bfloat16's precision."""
    plain = _keras_fit(_conv_bn, None, policy="mixed_bfloat16")
    ours = _keras_or_no_bottleneck(_conv_bn, checkpoints, policy="mixed_bfloat16",
                                   offload="auto")
    if ours is not None:
        assert all(np.all(np.isfinite(g)) for g in ours)
        # bfloat16 keeps 8 bits of mantissa; batch norm amplifies the rounding.
        assert _worst(plain, ours) <= 0.15


@pytest.mark.heavy
@pytest.mark.parametrize("offload", OFFLOAD)
@pytest.mark.parametrize("skip", [True, False], ids=["skip", "no_skip"])
@pytest.mark.parametrize("checkpoints", KERAS_STRATEGIES)
def test_keras_rnn_with_dropout_in_its_cell(checkpoints, skip, offload):
    """A keras.layers.RNN whose cell applies Dropout in call(): the loop is
    stateful, so memsave keeps it and differentiates it in place."""
    build = _rnn_dropout_cell(skip)
    plain = _keras_fit(build, None, dtype="float64")
    ours = _keras_or_no_bottleneck(build, checkpoints, dtype="float64", offload=offload)
    if ours is not None:
        assert _worst(plain, ours) <= 1e-9


# ---------------------------------------------------------------- found by a helper trying to break memsave

def _penalty_through(kind):
    """Double backprop: a gradient penalty through a while loop or a cond. The
    loop's (cond's) gradient is itself a while (cond) whose bodies are
    TensorFlow's gradient graphs; memsave keeps it in place."""
    def forward(ws):
        w, = ws
        x = tf.constant(np.random.RandomState(9).randn(4, 8))
        if kind == "while":
            h = tf.while_loop(lambda i, h: i < 2, lambda i, h: (i + 1, tf.tanh(h @ w)),
                              [tf.constant(0), x])[1]
        else:
            h = tf.cond(tf.reduce_sum(x) > -1e9, lambda: tf.tanh(x @ w), lambda: x)
        d = tf.reduce_sum(h ** 2)
        gx = tf.gradients(d, x)[0]
        return d + tf.reduce_sum(gx ** 2), [w], [h]
    return _Case(_weights(9, (8, 8)), forward)


def _read_and_variable(ws):
    """A variable and its read value, both as xs."""
    w, w2 = ws
    r = w.value()   # the ReadVariableOp output
    h = tf.tanh(tf.constant(np.random.RandomState(10).randn(4, 8)) @ r)
    return tf.reduce_sum(tf.tanh(h @ w2) ** 2), [w, r, w2], [h]


OTHERS = {"penalty_through_while": _penalty_through("while"),
          "penalty_through_cond": _penalty_through("cond"),
          "variable_and_its_read": _Case(_weights(10, (8, 8), (8, 8)), _read_and_variable)}


@pytest.mark.parametrize("mode", sorted(RUNNERS))
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", sorted(OTHERS))
def test_found_by_breaking(case, strategy, mode):
    assert RUNNERS[mode](OTHERS[case], strategy, None) <= 1e-9


# How _lookups reads its table: as Keras does (a gather), a gather inside a
# function the step calls, sparse segment reductions asked for a sparse
# gradient (one row per distinct id, found by a helper: 24 rows for 6 ids
# where recomputed in four segments, Adam's step on them 0.9 of its size
# off), and two lookups of the variable itself, early and late (found by a
# helper: the early one's rows came first, where plain puts the late one's).
LOOKUPS = ("gather", "gather_in_a_call", "sparse_segment_sum", "sparse_segment_mean",
           "sparse_segment_sqrt_n", "variable_twice")


def _lookups(table, ws, lookup="gather"):
    """An embedding read, with repeated ids, that every layer reads again: a
    plan keeping the layers recomputes the lookup in each of their
    segments (``lookup``: one of :data:`LOOKUPS`)."""
    ids = tf.constant(np.random.RandomState(13).randint(0, 6, 24))
    if lookup == "gather":
        e = tf.gather(table.value(), ids)
    elif lookup == "gather_in_a_call":
        e = tf.function(lambda t: tf.gather(t, ids) * 2)(table.value())
    elif lookup == "variable_twice":
        e = tf.nn.embedding_lookup(table, ids)
    else:
        e = getattr(tf.sparse, lookup[len("sparse_"):])(
            table.value(), ids, tf.constant(np.arange(24) // 4), sparse_gradient=True)
    h, layers = e, []
    for i, w in enumerate(ws):
        h = tf.tanh(h @ w) + e
        if lookup == "variable_twice" and i == len(ws) // 2:
            h += tf.nn.embedding_lookup(table, tf.fill([24], 4))
        layers.append(h)
    return tf.reduce_sum(h * h), [table] + ws, layers[:-1]


@pytest.mark.parametrize("lookup", LOOKUPS)
@pytest.mark.parametrize("mode", sorted(RUNNERS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_embeddings_gradient_has_plains_rows(strategy, mode, lookup):
    # Plain's rows, in plain's order: an optimizer that squares the rows
    # (Adam) sees what it sees under plain backprop.
    def both(vs):
        loss, xs, listed = _lookups(vs[0], vs[1:], lookup)
        return tf.gradients(loss, xs), _ours(loss, xs, listed, strategy, None)

    _assert_plains_rows(mode, _weights(13, (6, 8), (8, 8), (8, 8), (8, 8)), both)


def _assert_plains_rows(mode, make, both):
    """``both(variables)`` gives (plain's gradients, memsave's), run in a
    Session or a tf.function (``mode``) on the variables ``make()`` makes:
    the first is sparse in both, with plain's indices in plain's order and
    plain's rows; the others are plain's."""
    if mode == "session":
        with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
            graphs = both(make())
            sess.run(tf.compat.v1.global_variables_initializer())
            plain, ours = sess.run(graphs)
    else:
        vs = make()
        plain, ours = tf.function(lambda: both(vs))()
    assert hasattr(ours[0], "indices") and hasattr(plain[0], "indices")
    np.testing.assert_array_equal(np.asarray(ours[0].indices), np.asarray(plain[0].indices))
    plain, ours = [[np.asarray(grads[0].values)]
                   + [None if g is None else np.asarray(g) for g in grads[1:]]
                   for grads in (plain, ours)]
    assert _worst(plain, ours) <= 1e-12


def _two_lookups(table, ws, where):
    """One table looked up twice, the older lookup's gradient reached later
    by plain backprop (``where='segments'``: an encoder's and a decoder's
    token embedding, as in T5, the two in different segments), or earlier
    (``'one call'``: two reads of the variable itself, never recomputed,
    differentiated in one call); returns (loss, xs, checkpoints)."""
    c = tf.constant(np.random.RandomState(5).randn(5, 6))
    ids_a, ids_b = tf.constant([0, 1, 2, 3, 4]), tf.constant([7, 8, 9, 10, 11])
    if where == "segments":
        a = tf.gather(table.value(), ids_a)
        p = tf.tanh(c @ ws[0])
        h1 = tf.tanh(a @ ws[1] + p)
        h2 = tf.tanh(h1 @ ws[2])
        h3 = tf.tanh(h2 @ ws[3])
        b = tf.gather(table.value(), ids_b)
        d = tf.tanh(tf.tanh(b @ ws[4] + h3) @ ws[5])
        return tf.reduce_sum(d * d), [table] + ws, [p, h1, h2, b]
    a = tf.gather(table, ids_a)
    b = tf.gather(table, ids_b)
    h = b
    for w in ws[:4]:
        h = tf.tanh(h @ w)
    return tf.reduce_sum(h * h) + tf.reduce_sum(a * tf.tanh(c)), [table] + ws[:4], [h]


@pytest.mark.parametrize("where", ["segments", "one call"])
@pytest.mark.parametrize("mode", sorted(RUNNERS))
def test_a_tables_rows_come_in_plains_order(mode, where):
    # A table read by two lookups: plain concatenates their rows in the
    # order its backward queue takes the lookups; memsave concatenated them
    # in the order its segments ran (the decoder's token embedding of a
    # keras-hub T5, kept, after the encoder's), or the newest first within
    # one call (two reads of the variable itself, a helper's fuzzed graph):
    # the same sum, but an optimizer adds the rows of one id in another order.
    def both(vs):
        loss, xs, listed = _two_lookups(vs[0], vs[1:], where)
        return tf.gradients(loss, xs), memsave.gradients(loss, xs, checkpoints=listed,
                                                         min_checkpoint_size=0)

    _assert_plains_rows(mode, _weights(21, (12, 6), *[(6, 6)] * 6), both)


@pytest.mark.parametrize("lookup", ["gather", "sparse_segment_sum"])
def test_the_audit_catches_sparse_rows_given_per_segment(monkeypatch, lookup):
    """Without keeping the lookup, the audit refuses the rewrite."""
    from memsave import rewrite   # pylint: disable=import-outside-toplevel
    monkeypatch.setattr(rewrite, "differentiated_once", lambda region, kept: list(kept))
    with tf.Graph().as_default():
        table, ws = _split(_weights(13, (6, 8), (8, 8), (8, 8))())
        loss, xs, listed = _lookups(table, ws, lookup)
        with pytest.raises(memsave.GradientMismatchError, match="gives sparse gradient rows"):
            memsave.gradients(loss, xs, checkpoints=listed)


def _split(vs):
    return vs[0], vs[1:]


def test_a_sparse_gradient_that_is_not_finite_is_nan_throughout():
    from memsave.rewrite import non_finite_throughout   # pylint: disable=C0415
    rows = np.array([[1.0, -0.0], [2.0, 3.0]], np.float32)
    finite = non_finite_throughout(tf.IndexedSlices(tf.constant(rows), tf.constant([4, 4])))
    assert np.array_equal(finite.values.numpy(), rows)
    assert np.signbit(finite.values.numpy()[0, 1])    # the very values, -0.0 too
    rows[1, 0] = np.inf   # a finite duplicate row would hide it from Keras' check
    poisoned = non_finite_throughout(tf.IndexedSlices(tf.constant(rows), tf.constant([4, 4])))
    assert np.isnan(poisoned.values.numpy()).all()
    np.testing.assert_array_equal(poisoned.indices.numpy(), [4, 4])


def test_eager_constant_as_an_x_inside_tf_function():
    """tf.gradients captures an eager x (frozen weights) into the function; so must memsave."""
    w = tf.constant(np.random.RandomState(11).randn(8, 8))
    x = tf.constant(np.random.RandomState(12).randn(4, 8))

    @tf.function
    def step():
        loss = tf.reduce_sum(tf.tanh(tf.tanh(x @ w) @ w) ** 2)
        return tf.gradients(loss, [w]), memsave.gradients(loss, [w], checkpoints="optimal",
                                                          min_checkpoint_size=0)

    plain, ours = step()
    assert _worst(plain, ours) <= 1e-12


_EAGER_ROWS = tf.constant(np.random.RandomState(16).randint(0, 40, 32), tf.int32)
_EAGER_GRADIENT = tf.constant(np.random.RandomState(17).randn(32, 16))


@tf.custom_gradient
def _rows_with_eager_indices(table):
    """A gather whose gradient is IndexedSlices on indices made outside the function."""
    def grad(dy):
        return tf.IndexedSlices(dy, _EAGER_ROWS, tf.constant([40, 16]))
    return tf.gather(table, _EAGER_ROWS), grad


@tf.custom_gradient
def _tanh_with_an_eager_gradient(h):
    """tanh whose gradient is a constant made outside the function."""
    return tf.tanh(h), lambda dy: _EAGER_GRADIENT


@pytest.mark.parametrize("form", ["gradients", "tape"])
@pytest.mark.parametrize("strategy", ["optimal", "memory", "speed"])
def test_a_users_gradient_may_return_an_eager_tensor_it_closed_over(strategy, form):
    """A custom gradient returning an eager tensor (IndexedSlices' indices, a
    constant gradient) made outside the tf.function: TensorFlow hands it on
    as it is, and memsave walked its op ("Tensor.op is undefined when eager
    execution is enabled"), passed it on as the next segment's grad_ys, or
    logged its name in a segment's tf.gradients call (which TF's own does, so
    plain tf.gradients fails on the dense case; the tape runs it)."""
    rng = np.random.RandomState(18)
    table, w = tf.Variable(rng.randn(40, 16)), tf.Variable(rng.randn(16, 16) / 4)

    def forward():
        h = tf.tanh(_rows_with_eager_indices(table) @ w)
        h = tf.tanh(_tanh_with_an_eager_gradient(h @ w) @ w) if form == "tape" else h
        return tf.reduce_sum(tf.tanh(tf.tanh(h @ w) @ w) ** 2)

    @tf.function
    def step(ours):
        if form == "gradients":
            loss = forward()
            if not ours:
                return tf.gradients(loss, [table, w])
            return memsave.gradients(loss, [table, w], checkpoints=strategy, fallback=False,
                                     min_checkpoint_size=0)
        tape = (memsave.GradientTape(checkpoints=strategy, fallback=False, min_checkpoint_size=0)
                if ours else tf.GradientTape())
        with tape:
            loss = forward()
        return tape.gradient(loss, [table, w])

    plain, ours = step(False), step(True)
    assert [type(g) for g in plain] == [type(g) for g in ours]
    assert _worst([tf.convert_to_tensor(g) for g in plain],
                  [tf.convert_to_tensor(g) for g in ours]) <= 1e-12
    rewritten = step.get_concrete_function(True).graph.get_operations()
    assert any("memsave" in op.name for op in rewritten)


_READ_IN_BACKWARD = tf.constant(np.random.RandomState(19).rand(16))
_READ_IN_BACKWARD_VARIABLE = tf.Variable(np.random.RandomState(20).rand(16))


def _scaled_tanh(source):
    """tanh whose gradient is scaled by ``source()``, read only by the backward pass."""
    @tf.custom_gradient
    def scaled(h):
        y = tf.tanh(h)
        return y, lambda dy: dy * (1 - y * y) * source()
    return scaled


@pytest.mark.parametrize("read", ["constant", "variable"])
@pytest.mark.parametrize("form", ["gradients", "tape"])
@pytest.mark.parametrize("strategy", ["optimal", "speed"])
def test_a_value_only_a_users_gradient_reads_is_one_argument_for_every_segment(
        strategy, form, read):
    """A custom gradient reading a value from outside the function that the
    forward pass never reads (a closed-over constant or variable), run in two
    segments: the first captures it, the second reads that capture. The audit
    took the capture for an op of the first segment read without a fence
    (GradientMismatchError), under every strategy and Keras' fit."""
    rng = np.random.RandomState(21)
    ws = [tf.Variable(rng.randn(16, 16) / 4) for _ in range(2)]
    x = tf.constant(rng.randn(8, 16))
    scaled = _scaled_tanh((lambda: _READ_IN_BACKWARD) if read == "constant"
                          else (lambda: _READ_IN_BACKWARD_VARIABLE * 1.0))

    def forward():
        h = scaled(scaled(tf.tanh(x @ ws[0]) @ ws[1]) @ ws[1])
        return tf.reduce_sum(tf.tanh(h @ ws[0]) ** 2)

    plain, ours = _both_forms(forward, ws, strategy, form)
    assert _worst(plain, ours) <= 1e-12


def _both_forms(forward, xs, strategy, form):
    """(plain, memsave) gradients of ``forward()`` w.r.t. ``xs`` in a
    tf.function, by tf.gradients or by the tape; memsave's rewrite checked."""
    @tf.function
    def step(ours):
        if form == "gradients":
            loss = forward()
            if not ours:
                return tf.gradients(loss, xs)
            return memsave.gradients(loss, xs, checkpoints=strategy, fallback=False,
                                     min_checkpoint_size=0)
        tape = (memsave.GradientTape(checkpoints=strategy, fallback=False, min_checkpoint_size=0)
                if ours else tf.GradientTape())
        with tape:
            loss = forward()
        return tape.gradient(loss, xs)

    plain, ours = step(False), step(True)
    assert any("memsave" in op.name for op in step.get_concrete_function(True).graph
               .get_operations())
    return plain, ours


@pytest.mark.parametrize("form", ["gradients", "tape"])
def test_a_users_gradient_may_return_a_tensor_of_an_enclosing_function(form):
    """A step traced inside another tf.function whose custom gradient returns a
    tensor of the enclosing function's graph: captured, as an eager one is."""
    rng = np.random.RandomState(22)
    ws = [tf.Variable(rng.randn(8, 8) / 3) for _ in range(3)]
    x = tf.constant(rng.randn(4, 8))

    @tf.function
    def outer(ours):
        t = tf.tanh(x @ ws[0])

        @tf.custom_gradient
        def fixed(h):
            return tf.tanh(h), lambda dy: t

        def forward():
            return tf.reduce_sum(tf.sin(fixed(tf.tanh(t @ ws[1]) @ ws[2]) @ ws[2]) ** 2)

        @tf.function
        def inner():
            if form == "gradients":
                loss = forward()
                return (memsave.gradients(loss, ws[1:], checkpoints="optimal", fallback=False,
                                          min_checkpoint_size=0) if ours
                        else tf.gradients(loss, ws[1:]))
            tape = (memsave.GradientTape(checkpoints="optimal", fallback=False,
                                         min_checkpoint_size=0) if ours else tf.GradientTape())
            with tape:
                loss = forward()
            return tape.gradient(loss, ws[1:])
        return inner()

    assert _worst(outer(False), outer(True)) <= 1e-12


def test_ys_from_outside_the_function_are_read_as_tf_gradients_reads_them():
    """An eager y, or one of an enclosing function, among the ys inside a
    tf.function: tf.gradients captures it (it depends on no x); memsave
    refused the eager one and named the enclosing one another graph's."""
    rng = np.random.RandomState(23)
    w = tf.Variable(rng.randn(4, 4) / 2)
    x = tf.constant(rng.randn(2, 4))

    @tf.function
    def outer(ours):
        before = tf.tanh(x)

        @tf.function
        def inner():
            loss = tf.reduce_sum(tf.tanh(tf.tanh(x @ w) @ w) ** 2)
            ys = [loss, x, before]
            return (memsave.gradients(ys, [w], checkpoints="optimal", fallback=False,
                                      min_checkpoint_size=0) if ours else tf.gradients(ys, [w]))
        return inner()

    assert _worst(outer(False), outer(True)) <= 1e-12


def test_buffer_facts_agree_with_the_walk_through_chains_and_tf1_loops():
    """BufferFacts works out each tensor's possible buffers once from its
    inputs' (a DenseNet's concatenations, each of which may hand on the
    previous one, made the walk per tensor quadratic in depth) and gives what
    walking each tensor gives: reference variables behind identities,
    reshapes and concatenations, an in-place write behind a reshape, and a
    TF1 while loop, whose Merge may share a buffer with itself."""
    from memsave.graph import stateful   # pylint: disable=import-outside-toplevel
    graph = tf.Graph()
    with graph.as_default():
        s = tf.compat.v1.Variable(np.ones(4), use_resource=False)
        h = tf.reshape(tf.identity(s), [1, 4])
        written = tf.constant(np.ones((2, 4)))
        tf.raw_ops.InplaceUpdate(x=written, i=[0], v=tf.ones([1, 4], tf.float64))
        features = [tf.tanh(h), tf.reshape(written, [2, 4])]
        for _ in range(60):
            features.append(tf.concat([features[-1], tf.tanh(features[-1][:1])], axis=0))
        was_v2 = tf.compat.v1.control_flow_v2_enabled()
        tf.compat.v1.disable_control_flow_v2()
        try:
            loop = tf.compat.v1.while_loop(lambda i, x: i < 3,
                                           lambda i, x: (i + 1, tf.identity(x)),
                                           [tf.constant(0), tf.identity(s)])
        finally:
            if was_v2:
                tf.compat.v1.enable_control_flow_v2()
        tensors = [t for op in graph.get_operations() for t in op.outputs]
    facts = stateful.BufferFacts()

    def walked(t):
        return stateful.BufferFacts._walked(t)   # pylint: disable=protected-access
    for t in tensors:
        assert facts.of(t) == walked(t), t.name
    assert facts.of(features[-1])[1] and not facts.of(features[-1])[0]
    assert [r.op.name for r in facts.of(h)[0]] == [s.op.name]
    assert [r.op.name for r in stateful.ref_variables(loop[1])] == [s.op.name]
    # The loop's Merge reaches itself through the body's identity: walked whole.
    assert stateful.BufferFacts()._derived(loop[1]) is None   # pylint: disable=W0212


@pytest.mark.parametrize("strategy", ["optimal", "speed", "memory"])
@pytest.mark.parametrize("consumer", ["while", "call", "cond"])
def test_an_x_made_by_a_call_and_read_in_place_gets_its_gradient(consumer, strategy):
    """An x made by a function call in a Graph, another x above the call, the
    first read by an op differentiated in place with the call that makes
    it: the gradient arriving at the x is part of its result (it was None)."""
    called = tf.function(lambda a, w: tf.sin(tf.matmul(a, w)) + a)
    graph = tf.Graph()
    with graph.as_default():
        rng = np.random.RandomState(0)
        w = tf.Variable(rng.randn(8, 8) * 0.4)
        w2 = tf.Variable(rng.randn(8, 8) * 0.4)
        made = called(tf.tanh(tf.constant(rng.randn(4, 8))), w)
        if consumer == "while":
            _, out = tf.while_loop(lambda i, a: i < 2,
                                   lambda i, a: (i + 1, tf.tanh(tf.matmul(a, w2))), [0, made])
        elif consumer == "call":
            out = called(made, w2)
        else:
            out = tf.cond(tf.reduce_sum(w2) > -1e9, lambda: tf.tanh(made @ w2),
                          lambda: made * 2.0)
        loss = tf.reduce_sum(tf.tanh(tf.matmul(out, w2)) ** 2)
        xs = [made, w]
        grads = memsave.gradients(loss, xs, checkpoints=strategy, fallback=False,
                                  min_checkpoint_size=1)
    assert all(g is not None for g in grads)
    assert_same_as_plain(graph, loss, xs, grads)


def test_a_probe_of_a_compiled_call_leaves_tensorflows_caches_as_the_step_builds_them():
    """A jit-compiled function around a ``tf.recompute_grad`` block (its
    gradient runs a tape): memsave's gradients, and a plain tape's on the
    same function afterwards, are plain's (they were all zeros)."""
    from memsave.graph import compiled_calls   # pylint: disable=import-outside-toplevel
    rng = np.random.RandomState(0)
    w = tf.Variable(rng.randn(8, 8) * 0.3)
    x = tf.constant(rng.randn(6, 8))

    def function():
        block = tf.recompute_grad(lambda a: tf.tanh(tf.tanh(a @ w) @ w))

        @tf.function(jit_compile=True)
        def f(a):
            return block(tf.sin(a)) * 2.0
        return f

    def gradient(tape_class, f):
        @tf.function
        def step():
            with tape_class() as tape:
                loss = tf.reduce_sum(f(x @ w) ** 2)
            return tape.gradient(loss, w)
        return step().numpy()

    plain = gradient(tf.GradientTape, function())
    f = function()
    compiled_calls._KNOWN.clear()   # the probe runs, as for a function first met
    ours = gradient(memsave.GradientTape, f)
    after = gradient(tf.GradientTape, f)
    scale = np.abs(plain).max()
    assert scale > 1
    assert np.abs(ours - plain).max() <= 1e-9 * scale
    assert np.abs(after - plain).max() <= 1e-9 * scale


def test_a_probe_of_a_compiled_call_adds_nothing_to_a_sessions_graph():
    """In a Session's graph the probe compiles eagerly, in its own thread: the
    user's graph gets no op from it (it got a random op, which moved later
    draws under a graph seed)."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.ones((4, 8))

        @tf.function(jit_compile=True)
        def f(a):
            return tf.tanh(a * 2.0)
        loss = tf.reduce_sum(f(x) * x)
        before = len(graph.get_operations())
        memsave.plan(loss, [x])
        assert len(graph.get_operations()) == before
