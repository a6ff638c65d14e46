"""The meter's breakdown of a peak, against the meter itself."""

import numpy as np
import pytest
import tensorflow as tf

from memsave.profile import peak_breakdown, peak_memory, session_step

MIB = 2 ** 20


def _step():
    """A step whose peak holds two known activations of 1 MiB and 4 MiB."""
    x = tf.constant(np.random.RandomState(0).rand(256, 1024).astype(np.float32))
    w = tf.Variable(np.random.RandomState(1).rand(1024, 1024).astype(np.float32) / 1024)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            h = tf.matmul(x, w, name="wide")
            big = tf.tile(h, [4, 1], name="big")            # 4 MiB, saved for the gradient
            loss = tf.reduce_sum(tf.tanh(big, name="squash"))
        return tape.gradient(loss, w)
    return step


def test_the_breakdown_explains_the_meters_peak():
    step = _step()
    measured = peak_memory(step)
    breakdown = peak_breakdown(step)
    assert breakdown.peak == measured
    # What the call allocated and still holds at the peak is the peak, up to
    # baseline tensors freed before it.
    assert sum(row[2] for row in breakdown.live) >= breakdown.peak
    sizes = {row[0]: row[2] for row in breakdown.live if row[0]}
    assert sizes.get("big", 0) >= 4 * MIB and sizes.get("wide", 0) >= MIB
    assert breakdown.live[0][2] == max(row[2] for row in breakdown.live)
    assert "MiB above the baseline" in breakdown.summary()


def test_a_session_step_and_bad_input():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.Variable(np.ones([512, 512], np.float32))
        y = tf.reduce_sum(tf.exp(x, name="grown") * x)
        grads = tf.gradients(y, [x])
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            step = session_step(sess, grads)
            breakdown = peak_breakdown(step)
            assert breakdown.peak == peak_memory(step)
            assert any(row[0] == "grown" and row[2] >= MIB for row in breakdown.live)
    with pytest.raises(TypeError, match="callable"):
        peak_breakdown(3)


def _event(allocated, addr, nbytes, in_use, op=None, kind="output"):
    stats = {"addr": addr, "allocation_bytes": nbytes, "bytes_allocated": in_use}
    if op:
        stats.update(tf_op=op, region_type=kind)
    return (0, allocated, stats)


def test_scratch_is_charged_to_its_op_or_to_the_last_op_named_before_it():
    from memsave.profile import _at_peak   # pylint: disable=import-outside-toplevel
    events = [
        _event(True, 1, 10, 110, "grad/a_grad/Mul"),            # an output
        _event(True, 2, 4, 114, "grad/a_grad/Mul", "temp"),     # its temporary
        _event(False, 2, 4, 110),
        _event(True, 3, 50, 160),                               # an XLA call's buffer
        _event(True, 4, 6, 166),
        _event(False, 3, 50, 116),
        _event(False, 4, 6, 110),
        _event(False, 9, 30, 80),                               # the baseline's, freed
        _event(True, 5, 20, 100, "grad/b_grad/Tanh"),
    ]
    breakdown = _at_peak(events, base=100)
    assert breakdown.peak == 66 and breakdown.at is None
    assert breakdown.unnamed == 56
    assert breakdown.scratch == (("grad/a_grad/Mul", 56),)
    assert breakdown.live[0] == (None, None, 56, 2)


def test_chunks_larger_than_asked_for_are_counted_as_slack():
    """BFC hands out a free chunk whole when it is under twice the request: a
    CI machine's 4 MiB weight gradient held a 7.63 MiB chunk, which the
    breakdown charges to the allocator, not to the tensor."""
    from memsave.profile import _at_peak   # pylint: disable=import-outside-toplevel
    big = _event(True, 1, 76, 176, "grad/w_grad/MatMul_1")
    big[2]["requested_bytes"] = 40
    events = [big, _event(True, 2, 40, 216, "grad/v_grad/MatMul_1"),
              _event(False, 1, 76, 140)]
    breakdown = _at_peak(events, base=100)
    assert breakdown.peak == 116
    assert breakdown.slack == 36
    assert "chunk slack" in breakdown.summary()


def test_a_temporary_handed_on_as_an_output_is_not_scratch():
    """TensorFlow's Einsum allocates its result as a temporary and hands it on
    as its output: attention's scores, forwarded through the softmax, are
    then held until the backward pass. Counted as the Einsum's scratch, a
    budget's replan modelled them twice (BERT at 1,024 tokens: its first
    plan estimated 522.5 MiB, measured 519.6, re-estimated 577.5). A
    temporary still held when the next op on its thread allocates, or when
    the call ends, is not scratch; one freed before is, on every thread."""
    from memsave.profile import _THREAD, _at_peak  # pylint: disable=C0415

    def on(thread, event):
        event[2][_THREAD] = thread
        return event

    events = [
        on(1, _event(True, 1, 4, 104, "einsum/Einsum", "temp")),     # a transposed input
        on(1, _event(True, 2, 40, 144, "einsum/Einsum", "temp")),    # the scores
        on(2, _event(True, 7, 3, 147, "other/MatMul", "temp")),      # another thread's
        on(1, _event(False, 1, 4, 143)),
        on(1, _event(True, 3, 40, 183, "Softmax_grad/mul")),         # the next op on 1
        on(2, _event(False, 7, 3, 180)),
        on(1, _event(True, 4, 8, 188, "grad/Einsum_1", "temp")),     # handed on at the end
        on(1, _event(False, 3, 40, 148)),
    ]
    breakdown = _at_peak(events, base=100)
    assert dict(breakdown.scratch) == {"einsum/Einsum": 4, "other/MatMul": 3}


def test_an_attention_steps_scores_are_not_counted_as_scratch():
    q = tf.random.stateless_normal([2, 4, 256, 16], seed=[1, 2])
    k = tf.random.stateless_normal([2, 256, 4, 16], seed=[3, 4])

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            tape.watch([q, k])
            probabilities = tf.nn.softmax(tf.einsum("bhqd,bkhd->bhqk", q, k))
            loss = tf.reduce_sum(probabilities * probabilities)
        return tape.gradient(loss, [q, k])

    breakdown = peak_breakdown(step, warmup=2)
    scores = 2 * 4 * 256 * 256 * 4
    assert any(op == "einsum/Einsum" and nbytes >= scores for op, _, nbytes, _ in breakdown.live)
    assert all(nbytes < scores for _, nbytes in breakdown.scratch), breakdown.scratch
