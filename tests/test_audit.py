"""The gradient-coverage audit catches each known bug, re-introduced by mutation.

Each test puts back one bug that memsave had (this issue's three classes
and the earlier correctness fixes), shows that without the audit the
result is silently wrong (or the graph cannot run), and that with the audit
``memsave.gradients`` raises ``GradientMismatchError`` naming the edge or
op. The audit itself is in :mod:`memsave.graph.audit`.
"""

import os

import numpy as np
import pytest
import tensorflow as tf

import memsave
from memsave import api, rewrite, tape as tape_module
from memsave.graph import edit, functions, region, stateful
from tests.test_known_classes import (CONV_BIAS, KEPT_CALLS, KEPT_CONV, KEPT_LOOPS,
                                      POW_READS_OFFLOADED, _in_function, _in_session, alone)


def _without_audit(monkeypatch):
    monkeypatch.setattr(api.audit, "check", lambda *args: None)


def _wrong_or_fails(run):
    """Without the audit: wrong gradients (relative error), or TensorFlow fails."""
    try:
        return run() > 1e-3
    except tf.errors.OpError:
        return True


def _caught(run, match):
    with pytest.raises(memsave.GradientMismatchError, match=match):
        run()


# ---------------------------------------------------------------- this classes

def _float_only(t):
    return t.dtype.is_floating or t.dtype.is_complex


def test_kept_loop_without_its_tensor_list_input(monkeypatch):
    """A kept loop's TensorList (variant) input not forced: its gradient is lost."""
    monkeypatch.setattr(region, "carries_gradient", _float_only)
    case = KEPT_LOOPS["map_fn_dropout"]
    _caught(lambda: _in_function(case, "list", None),
            r"the gradient arriving at map/while .* is dropped")
    _without_audit(monkeypatch)
    assert _in_function(case, "list", None) > 0.1


def _hiding_gates(real):
    def segment_reads(copies, boundary, stop, read_as, region_ops):
        visible = edit.Copies()
        visible.of = copies.of
        visible.made = [op for op in copies.made if op in set(copies.of.values())]
        return real(visible, boundary, stop, read_as, region_ops)
    return segment_reads


def test_gate_hides_the_swap_in_it_reads(monkeypatch):
    """What a segment reads derived from the copies only: a gated Pow's
    offloaded input is not asked for."""
    monkeypatch.setattr(rewrite, "_segment_reads", _hiding_gates(rewrite._segment_reads))
    _caught(lambda: _in_session(POW_READS_OFFLOADED, "list", "auto"),
            r"ReadVariableOp:0 -> matmul_1 \(input 1\) is dropped")
    # Without the audit, here only the None guard refuses it (w1 has no other
    # path); with another path to w1 the lost one went unnoticed.
    _without_audit(monkeypatch)
    _caught(lambda: _in_session(POW_READS_OFFLOADED, "list", "auto"), "None for")


def test_segments_without_fences(monkeypatch):
    """Gradient sums handed on unfenced: a fusion may close a cycle (oneDNN
    does on float32 convolutions); the audit sees it in any dtype."""
    monkeypatch.setattr(rewrite, "fence", lambda grad: grad)
    _caught(lambda: _in_session(CONV_BIAS, "list", None), "without a fence")


def test_first_segment_waiting_for_the_ys_themselves(monkeypatch):
    """Found on MobileNetV3Small: in a step returning only the gradients,
    Grappler handed the first segment's wait on the loss down to a kept
    convolution, which oneDNN fused with the copy of its bias add: a cycle.
    The audit sees the unfenced wait in any dtype, with oneDNN on or off."""
    monkeypatch.setattr(rewrite, "_first_waits", lambda ys, grad_ys: list(ys))
    _caught(lambda: alone(KEPT_CONV, "list", None, "function"),
            "waits for .*, an op of the graph it rewrites")
    if os.environ.get("TF_ENABLE_ONEDNN_OPTS") == "1":
        _without_audit(monkeypatch)
        assert _wrong_or_fails(lambda: alone(KEPT_CONV, "list", None, "function"))


def test_kept_op_reading_a_call_output(monkeypatch):
    """Found by the fuzzer: tf.gradients differentiates a function call even at
    a stop, so a call feeding a kept op is differentiated in the kept op's
    segment; asked for there as well, its gradient was counted twice."""
    monkeypatch.setattr(region, "in_place_closure", lambda in_place, ops: list(in_place))
    monkeypatch.setattr(rewrite, "in_place_closure", lambda in_place, ops: list(in_place))
    case = KEPT_CALLS
    _caught(lambda: _in_function(case, "optimal", None), "counted 2 times")
    _without_audit(monkeypatch)
    assert _wrong_or_fails(lambda: _in_function(case, "optimal", None))


# ---------------------------------------------------------------- earlier fixes

def _call_checkpoint_case():
    """A checkpoint made by a tf.function call (see test_op_families)."""
    rng = np.random.RandomState(3)
    w = tf.Variable(rng.randn(8, 8) / 3)
    x0 = rng.randn(4, 8)
    inner = tf.function(lambda a: tf.tanh(a @ w) * 1.5)

    def forward():
        x = tf.constant(x0)
        below = tf.tanh(x @ w)
        h = inner(below)
        top = tf.tanh(h @ w) * x
        return tf.reduce_sum(top * top), [w], [h]
    return forward


def _run_function(forward, checkpoints):
    @tf.function
    def step():
        loss, xs, listed = forward()
        ours = memsave.gradients(loss, xs, min_checkpoint_size=0,
                                 checkpoints=listed if checkpoints == "list" else checkpoints)
        return tf.gradients(loss, xs), ours

    plain, ours = step()
    return max(float(np.abs(a - b).max() / np.abs(a).max()) for a, b in zip(plain, ours))


def test_call_output_read_without_a_shield(monkeypatch):
    """tf.gradients differentiates a function call even when its output is a
    stop: without the Identity shield, the call's inputs get its gradient twice."""
    monkeypatch.setattr(rewrite, "_shields", lambda region_, checkpoints: {})
    forward = _call_checkpoint_case()
    _caught(lambda: _run_function(forward, "list"), "counted 2 times")
    _without_audit(monkeypatch)
    assert _wrong_or_fails(lambda: _run_function(forward, "list"))


def test_control_flow_copied_without_its_bodies(monkeypatch):
    """A While copied without deep copies of its bodies: TensorFlow's gradient
    rebuilds them from the function library and loses the nested loop's
    captured variable."""
    monkeypatch.setattr(functions, "copy_bodies", lambda op, inputs, graph, create: ({}, {}))
    from tests.test_op_families import WhileInWhile   # pylint: disable=import-outside-toplevel
    family = WhileInWhile()

    variables = family.variables()

    @tf.function   # (in a Session, a loop reading a variable is kept, not copied)
    def run():
        out = family.forward(variables)
        return memsave.gradients(out["ys"], out["xs"], checkpoints=out["checkpoints"])

    _caught(run.get_concrete_function, "has no _body_graph")


def _read_after_write_caught_then_wrong(monkeypatch, kind, match):
    """The step ``kind`` of :func:`_write_after_read_step`, its read recomputed
    after the step's write of v: the audit raises ``match``; without it, the
    gradients are off plain's."""
    from tests.test_updates_in_step import _write_after_read_step  # pylint: disable=C0415
    rng = np.random.RandomState(0)
    v = tf.Variable(np.full([64], 0.3, np.float32))
    w = tf.Variable((rng.randn(64, 64) / 8).astype(np.float32))

    def run(grad_fn):
        v.assign(np.full([64], 0.3, np.float32))
        step = tf.function(lambda: _write_after_read_step(kind, grad_fn, v, w))
        return [t.numpy() for t in step()]

    def ours(loss, xs, below):
        return memsave.gradients(loss, xs, checkpoints=[below], min_checkpoint_size=0)

    _caught(lambda: run(ours), match)
    _without_audit(monkeypatch)
    plain = run(lambda loss, xs, below: tf.gradients(loss, xs))
    got = run(ours)
    assert max(float(np.abs(a - b).max() / np.abs(a).max()) for a, b in zip(plain, got)) > 1e-3


def test_recomputed_read_after_a_write(monkeypatch):
    """In a tf.function, a cond reading a variable that the step writes after
    it must be kept: its recomputation would read the new value."""
    monkeypatch.setattr(region, "written_handles", lambda graph, ops: {})
    _read_after_write_caught_then_wrong(monkeypatch, "cond",
                                        r"cond.* is recomputed after .* may have written")


def test_recomputed_call_reading_a_variable_through_an_identity(monkeypatch):
    """A call given ``tf.identity(v.handle)`` reads v: recomputed after the
    step's write of v, it read the new value (found by a helper)."""

    pinned = region.is_pinned

    def through_identities_unseen(op, written=None, facts=None):
        if op.type in stateful.FUNCTION_CALLS and any(
                t.dtype == tf.resource and t.op.type == "Identity" for t in op.inputs):
            return False
        return pinned(op, written, facts)
    monkeypatch.setattr(region, "is_pinned", through_identities_unseen)
    _read_after_write_caught_then_wrong(monkeypatch, "call_through_an_identity",
                                        r"is recomputed after .*AssignAdd.* may have written")


def test_recomputed_call_reading_a_variable_in_a_session(monkeypatch):
    """In a Session, an optimizer's update made after the gradients may run
    before a recomputed cond that reads the variable in its body."""

    from tests.test_updates_in_step import _session_step  # pylint: disable=C0415
    monkeypatch.setattr(stateful, "_read_by_calls", lambda region_ops: {})
    _caught(lambda: _session_step("cond", True), r"cond.* reads .* in its body and is recomputed")
    _without_audit(monkeypatch)
    plain, got = _session_step("cond", False), _session_step("cond", True)
    assert max(float(np.abs(a - b).max()) for a, b in zip(plain, got)) > 1e-3 * max(
        float(np.abs(a).max()) for a in plain)


def test_tape_asks_the_placeholder_of_a_nested_call_variable(monkeypatch):
    """Keras runs a grouped Conv2D as a nested call, which the tape records on
    the variable's own handle: asking the tape about the captured placeholder
    instead routes the kernel to None."""
    keras = pytest.importorskip("keras")

    def placeholders(tape, flat_raw, flat_xs):
        return tape_module._tracked(tape, [x for x in flat_xs if x is not None])

    monkeypatch.setattr(tape_module, "_sources_tracked", placeholders)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((12, 12, 8)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(16, 3, groups=4, padding="same", activation="relu"),
        keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(3)])
    x = tf.constant(np.random.RandomState(0).randn(4, 12, 12, 8).astype(np.float32))

    @tf.function
    def step():
        with memsave.GradientTape(checkpoints="optimal", min_checkpoint_size=0) as tape:
            loss = tf.reduce_sum(model(x) ** 2)
        return tape.gradient(loss, model.trainable_variables)

    _caught(step, "the tape recorded .* reading the variable")


# ---------------------------------------------------------------- the running sums

def _residual_case():
    """Checkpoints whose gradient comes from two segments (a skip)."""
    rng = np.random.RandomState(6)
    ws = [tf.Variable(rng.randn(8, 8) / 3) for _ in range(4)]
    x = tf.constant(rng.randn(4, 8))
    hs = [tf.tanh(x @ ws[0])]
    hs.append(tf.tanh(hs[0] @ ws[1]))
    hs.append(tf.tanh(hs[1] @ ws[2]) + hs[0])
    loss = tf.reduce_sum(tf.tanh(hs[2] @ ws[3]) ** 2)
    return loss, ws, [hs[0], hs[1], hs[2]]


def _session_worst(build):
    graph = tf.Graph()
    with graph.as_default():
        loss, ws, listed = build()
        ours = memsave.gradients(loss, ws, checkpoints=listed, min_checkpoint_size=0)
        plain = tf.gradients(loss, ws)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            a, b = sess.run([plain, ours])
    return max(float(np.abs(p - q).max() / np.abs(p).max()) for p, q in zip(a, b))


@pytest.mark.parametrize("mutation,match", [
    ("first_only", "is dropped"),
    ("twice", "already summed"),
])
def test_running_sums(monkeypatch, mutation, match):
    """A running sum that keeps only its first partial, or adds each twice."""
    real = rewrite._Accumulator.add

    def add(self, t, grad, *position):
        if mutation == "first_only" and self.total(t) is not None:
            return None
        real(self, t, grad, *position)
        if mutation == "twice":
            real(self, t, grad, *position)
        return None

    monkeypatch.setattr(rewrite._Accumulator, "add", add)
    _caught(lambda: _session_worst(_residual_case), match)
    _without_audit(monkeypatch)
    assert _session_worst(_residual_case) > 1e-3


def _shared_weight_case():
    """One weight in every layer: a segment asks for it and for a checkpoint
    that depends on it, so only the stop holds backprop at the checkpoint."""
    rng = np.random.RandomState(7)
    w = tf.Variable(rng.randn(8, 8) / 3)
    h = tf.constant(rng.randn(4, 8))
    hs = []
    for _ in range(4):
        h = tf.tanh(h @ w)
        hs.append(h)
    return tf.reduce_sum(h ** 2), [w], hs[1:3]


def test_segment_forgets_its_stops(monkeypatch):
    """A segment whose tf.gradients call does not stop at the checkpoints it
    reads differentiates the forward pass below them a second time."""
    monkeypatch.setattr(rewrite, "_segment_stops",
                        lambda read_cp, user_stops, copies, barred:
                        [copies.output(t) for t in user_stops])
    _caught(lambda: _session_worst(_shared_weight_case), "counted 2 times")
    _without_audit(monkeypatch)
    assert _session_worst(_shared_weight_case) > 1e-3


@pytest.mark.parametrize("case, op_type", [
    ("fractional_avg_pool", "FractionalAvgPool"),
    ("unseeded_deterministic_max_pool", "FractionalMaxPool"),
    ("glimpse_uniform", "ExtractGlimpseV2"),
    ("input_written_in_place", "InplaceAdd")])
def test_recomputed_op_that_differs_when_run_again(monkeypatch, case, op_type):
    """Ops TensorFlow declares stateless that draw anew (a fractional pool with
    seed=0, a glimpse's noise) or write their input in place: pinned, and the
    audit refuses a plan that recomputes one."""
    from tests import test_known_classes as known  # pylint: disable=C0415
    pinned = region.is_pinned
    monkeypatch.setattr(region, "is_pinned", lambda op, written=None, facts=None: (
        op.type != op_type and pinned(op, written, facts)))
    # A list keeps only what is above the pool or glimpse; 'memory' keeps the
    # buffer InplaceAdd writes into.
    case, strategy = ((known.INPUT_WRITTEN_IN_PLACE, "memory") if case == "input_written_in_place"
                      else (known.RANDOM_WITHOUT_STATE[case], "list"))
    _caught(lambda: _in_session(case, strategy, None), op_type + r".* is recomputed")
    _without_audit(monkeypatch)
    # A pool with seed=0 draws its windows anew: a copy may draw the same ones
    # by chance (small pools have few), so a few graphs are tried.
    assert any(_wrong_or_fails(lambda: _in_session(case, strategy, None)) for _ in range(5))


def test_recomputed_tensor_left_feedable(monkeypatch):
    """In a Session, a fed tensor that a copy computes again: the copy would not
    see the fed value."""
    from tests.test_known_classes import _carried_state  # pylint: disable=C0415
    monkeypatch.setattr(tf.Graph, "prevent_feeding", lambda graph, tensor: None)

    def run():
        graph = tf.Graph()
        with graph.as_default():
            state, layers, loss, xs = _carried_state(feedable=False)
            ours = memsave.gradients(loss, xs, checkpoints=[layers[2]])
            plain = tf.gradients(loss, xs)
            with tf.compat.v1.Session(graph=graph) as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                feed = {state: np.random.RandomState(16).randn(4, 8)}
                p, o = sess.run([plain, ours], feed)
        return max(float(np.abs(a - b).max()) for a, b in zip(p, o)) / max(
            float(np.abs(a).max()) for a in p)

    _caught(run, r"is recomputed, but a Session may feed it")
    _without_audit(monkeypatch)
    assert _wrong_or_fails(run)


@pytest.mark.parametrize("read", ["read", "identity", "reshape", "slice", "assign"])
def test_recomputed_read_of_a_reference_variable_written_in_place(monkeypatch, read):
    """A TF1 variable's read shares its buffer, and so may an identity, a
    reshape or a full slice of it and the ref an assign returns: an op
    reading one, recomputed after an assign_add of the same run, saw the
    new value."""
    from tests.test_known_classes import written_in_place  # pylint: disable=C0415
    pinned = region.is_pinned

    def pinned_but_not_for_references(op, written=None, facts=None):
        # The planner's protection off (it sees no reference variable behind
        # any input); the audit's (stateful.ref_variables) on.
        facts_of = stateful.BufferFacts.of
        stateful.BufferFacts.of = lambda self, t: ((), facts_of(self, t)[1])
        try:
            return pinned(op, written, facts)
        finally:
            stateful.BufferFacts.of = facts_of
    monkeypatch.setattr(region, "is_pinned", pinned_but_not_for_references)

    def run():
        graph, loss, ws = written_in_place(read)
        with graph.as_default():
            ours = memsave.gradients(loss, ws, checkpoints="speed")
            plain = tf.gradients(loss, ws)
            with tf.compat.v1.Session(graph=graph) as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                p, o = sess.run([plain, ours])
        return max(float(np.abs(a - b).max()) for a, b in zip(p, o)) / max(
            float(np.abs(a).max()) for a in p)

    _caught(run, r"is recomputed after .*AssignAdd.* may have written")
    _without_audit(monkeypatch)
    assert _wrong_or_fails(run)
