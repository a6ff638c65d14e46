"""Measure peak memory of one step (and estimate it before running).

The figure is the allocator's peak above the pre-step baseline, from
``tf.config.experimental.get_memory_info``. On CPU it is repeatable (about 1%
for Session runs) with the BFC allocator (``TF_CPU_ALLOCATOR_USE_BFC=true``,
read when the TensorFlow runtime starts) and one inter-op thread, which fixes
the execution order.
"""

import logging
import os

import tensorflow as tf

from memsave.log import warn_once

logger = logging.getLogger("memsave")

ENV_HINT = ("set TF_CPU_ALLOCATOR_USE_BFC=true in the environment before TensorFlow "
            "runs its first op")


def default_device():
    """'GPU:0' when a GPU is visible, else 'CPU:0'."""
    return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


def memory_info(device=None):
    """``{'current': bytes, 'peak': bytes}`` for ``device``, or a clear error."""
    device = device or default_device()
    try:
        info = tf.config.experimental.get_memory_info(device)
    except (ValueError, RuntimeError) as e:
        raise RuntimeError("memsave.profile: no allocator statistics for %s (%s); %s"
                           % (device, e, ENV_HINT)) from None
    if device.startswith("CPU") and os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").lower() != "true":
        warn_once("profile:bfc", "memsave.profile: TF_CPU_ALLOCATOR_USE_BFC is not 'true'; "
                  "CPU peaks come from the default allocator and are less repeatable; "
                  + ENV_HINT)
    return info


def peak_memory(step, *args, device=None, warmup=1, **kwargs):
    """Peak bytes allocated above the pre-step baseline during one ``step``.

    ``step`` is any callable (``sess.run`` with its fetches bound, a
    ``tf.function``, ...); it is called ``warmup`` times first so that graph
    building, tracing and Grappler do not count, then once measured.
    """
    if not callable(step):
        raise TypeError("peak_memory needs a callable step, got %r" % (step,))
    for _ in range(warmup):
        step(*args, **kwargs)
    return measured_call(step, *args, device=device, **kwargs)[1]


def measured_call(step, *args, device=None, **kwargs):
    """``(step(*args, **kwargs), peak bytes above the pre-call baseline)``: one
    call, measured (RuntimeError without allocator statistics)."""
    device = device or default_device()
    memory_info(device)
    tf.config.experimental.reset_memory_stats(device)
    base = memory_info(device)["current"]
    result = step(*args, **kwargs)
    peak = memory_info(device)["peak"] - base
    logger.debug("memsave.profile: peak %d bytes above a baseline of %d on %s", peak, base, device)
    return result, peak


def session_step(session, fetches, feed_dict=None):
    """A callable running ``fetches`` once in ``session`` (for ``peak_memory``)."""
    def step():
        session.run(fetches, feed_dict=feed_dict)
    return step


def configure_for_measurement():
    """Set the allocator and threading the meter needs.

    Call it before the first TensorFlow op runs: both settings are read when
    the runtime starts. Returns False (and logs) if that was too late.
    """
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    try:
        tf.config.threading.set_inter_op_parallelism_threads(1)
    except RuntimeError:
        logger.warning("memsave.profile: TensorFlow is already initialized; "
                       "inter-op threads stay as they are")
        return False
    return True


def estimate_peak(ys, xs, checkpoints="optimal", **plan_kwargs):
    """Estimated peak bytes of the backward pass, before running it.

    ``checkpoints=None`` estimates plain ``tf.gradients``. The estimate
    simulates the rewrite's schedule on the planning graph (see
    :mod:`memsave.planning.simulate`); it counts activations, their gradients
    and the weight gradients (pieces and sums), not the weights themselves.
    """
    from memsave.api import plan  # pylint: disable=import-outside-toplevel
    if checkpoints is None:
        return plan(ys, xs, checkpoints=[], **plan_kwargs).plain_peak_bytes
    return plan(ys, xs, checkpoints=checkpoints, **plan_kwargs).estimated_peak_bytes
