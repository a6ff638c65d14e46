"""Public entry points: drop-in replacements for ``tf.gradients``."""

import contextlib
import gc
import logging
import threading

import tensorflow as tf

from memsave import tf_internal
from memsave import verify as verify_module
from memsave.errors import GradientMismatchError
from memsave.log import warn_once
from memsave.planning.plan import MIN_SAVING, Plan
from memsave.graph import audit, graph_tensor, reaches_xs_through_captures
from memsave.graph.region import analyze
from memsave.graph.walk import differentiably_connected
from memsave.planner import plan_region
from memsave.rewrite import SwapConfig, non_finite_throughout, plain_gradients, rewrite
from memsave.settings import resolve

logger = logging.getLogger("memsave")

# Rewrites in progress in this thread (see differentiate: a gradient function
# that takes gradients, run while one is built, gets plain tf.gradients).
_rewriting = threading.local()


def _as_list(value):
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def _check_graph_tensor(t, what):
    if isinstance(t, tf_internal.EagerTensor):
        raise TypeError(
            "memsave.gradients got an eager tensor in %s; it rewrites graphs, so call it "
            "inside a tf.function or a tf.compat.v1 Graph (for eager code, wrap the "
            "training step in tf.function)." % what)
    if not isinstance(t, (tf.Tensor, tf.IndexedSlices)):
        raise TypeError("%s must hold tf.Tensor objects, got %r" % (what, t))


def _as_ys(ys):
    """``ys`` as graph tensors, converted as ``tf.gradients`` converts them.

    Variables and Python numbers become tensors of the graph the other ys
    live in (else the default graph): a variable is read, a number is a
    constant, whose gradients are then unconnected. Inside a tf.function an
    eager y, or one of an enclosing function's graph, is captured, as
    tf.gradients reads it (it depends on no x of this graph).
    """
    ys = _as_list(ys)
    if not ys:
        return ys
    graphs = [y.graph for y in ys if isinstance(y, (tf.Tensor, tf.IndexedSlices))
              and not isinstance(y, tf_internal.EagerTensor)]
    default = tf.compat.v1.get_default_graph()
    graph = default if default in graphs or not graphs else graphs[0]
    out = []
    with graph.as_default():
        for y in ys:
            if (isinstance(graph, tf_internal.FuncGraph) and isinstance(y, tf.Tensor)
                    and (isinstance(y, tf_internal.EagerTensor) or y.graph is not graph)):
                out.append(graph_tensor(y, graph))   # else _validate names its graph
                continue
            if isinstance(y, tf_internal.EagerTensor) or isinstance(
                    y, (tf.Tensor, tf.IndexedSlices)):
                out.append(y)   # checked, with a clear message, by _validate
                continue
            try:
                out.append(tf.convert_to_tensor(y, name="y"))
            except (TypeError, ValueError) as e:
                raise TypeError("ys must hold tensors, variables or numbers, got %r (%s)"
                                % (y, e)) from None
    return out


def _tf_gradients_options(kwargs):
    """The ``tf.gradients`` keyword arguments, normalized the way it does."""
    kwargs = dict(kwargs)
    if "unconnected_gradients" in kwargs:
        value = kwargs["unconnected_gradients"]
        try:
            kwargs["unconnected_gradients"] = tf.UnconnectedGradients(value)
        except ValueError:
            raise ValueError("unknown value for unconnected_gradients: %r; use 'none' or "
                             "'zero' (tf.UnconnectedGradients)" % (value,)) from None
    if kwargs.get("stop_gradients") is not None:
        kwargs["stop_gradients"] = _as_list(kwargs["stop_gradients"])
    return kwargs


def _validate(ys, xs, grad_ys):
    for y in ys:
        _check_graph_tensor(y, "ys")
    graph = ys[0].graph
    for y in ys:
        if y.graph is not graph:
            raise ValueError("memsave.gradients: ys %s and %s live in different graphs"
                             % (ys[0].name, y.name))
    if grad_ys is not None and len(grad_ys) != len(ys):
        raise ValueError("memsave.gradients: %d grad_ys for %d ys" % (len(grad_ys), len(ys)))
    return graph


def _resolve_xs(xs, graph):
    resolved = []
    for x in xs:
        # Inside a tf.function an eager x (a constant, frozen weights) is
        # captured, as tf.gradients captures it; elsewhere it cannot be.
        if isinstance(x, tf_internal.EagerTensor) and not isinstance(graph,
                                                                   tf_internal.FuncGraph):
            _check_graph_tensor(x, "xs")
        try:
            t = graph_tensor(x, graph)
        except ValueError as e:
            raise ValueError("memsave.gradients: %s" % e) from None
        if not isinstance(t, tf.Tensor):
            raise TypeError("xs must hold tf.Tensor or tf.Variable objects, got %r" % (x,))
        if t.graph is not graph:
            raise ValueError("memsave.gradients: x %s is not in the graph of ys (%s)"
                             % (t.name, getattr(graph, "name", None) or repr(graph)))
        resolved.append(t)
    return resolved


def _resolve_grad_ys(grad_ys, ys, graph):
    if grad_ys is None:
        return None
    out = []
    for g, y in zip(grad_ys, ys):
        if g is None:
            out.append(None)
            continue
        if isinstance(g, tf_internal.EagerTensor) or not isinstance(
                g, (tf.Tensor, tf.IndexedSlices)):
            g = tf.convert_to_tensor(g, dtype=y.dtype)
        if g.graph is not graph:
            raise ValueError("memsave.gradients: grad_ys for %s is in another graph" % y.name)
        out.append(g)
    return out


# Graph rewriting is plain Python: autograph must not convert it when it is
# called inside a tf.function.
# What tf.gradients takes besides ys, xs and grad_ys; memsave.gradients passes them through.
TF_GRADIENTS_OPTIONS = ("name", "gate_gradients", "aggregation_method", "stop_gradients",
                        "unconnected_gradients", "colocate_gradients_with_ops")


# Graph rewriting is plain Python: autograph must not convert it when it is
# called inside a tf.function.
@tf.autograph.experimental.do_not_convert
def gradients(ys, xs, grad_ys=None, checkpoints="collection", **options):
    """Like ``tf.gradients``, but recomputes forward activations to save memory.

    ``checkpoints`` is 'optimal', 'memory', 'speed', 'collection' (tensors
    added to the graph's 'checkpoints' collection), a list of tensors to
    keep, or a strategy: any callable over the planning graph, or a name
    given to one with :func:`memsave.register_strategy` (see
    :mod:`memsave.planning.registry` and :mod:`memsave.planning.policies`).

    memsave's keywords are the same for every entry point (``budget``,
    ``max_recompute``, ``offload``, ``fallback``, ``min_checkpoint_size``,
    ``shapes``, ``batch_size``, ``verify``, ``xla``, ``offload_model``; see
    :mod:`memsave.settings` and docs/api.md). With the default
    ``fallback=True`` a named strategy whose estimated peak, on fully known
    sizes, is not below plain backprop's (without a budget or a cap: by
    at least ``MIN_SAVING``, 10% of it) returns plain ``tf.gradients``
    (logged at INFO). Under XLA each recomputed segment reads its inputs
    through an optimization barrier, as ``jax.checkpoint`` does; offloading
    is refused there (a list) or planned without ('auto').

    ``tf.gradients``' own keywords (``name``, ``gate_gradients``,
    ``aggregation_method``, ``stop_gradients``, ``unconnected_gradients``,
    ``colocate_gradients_with_ops``) mean what they mean there. Gradient ops
    are colocated with their forward ops unless ``colocate_gradients_with_ops=False``,
    as TF2's ``tf.gradients`` always does (``tf.compat.v1.gradients``, patched,
    keeps its own default of not colocating). Works in a ``tf.compat.v1`` Graph
    and inside ``tf.function``.
    """
    passed = {k: options.pop(k) for k in TF_GRADIENTS_OPTIONS if k in options}
    passed.setdefault("colocate_gradients_with_ops", True)
    settings = resolve(checkpoints, options, "memsave.gradients", extra=TF_GRADIENTS_OPTIONS)
    return differentiate(ys, xs, grad_ys, settings, **passed)


@tf.autograph.experimental.do_not_convert
def differentiate(ys, xs, grad_ys, settings, name="gradients", stops_hold=False,
                  **tf_gradients_kwargs):
    """:func:`gradients` with resolved :class:`~memsave.settings.Settings` (tapes, patch);
    ``stops_hold`` (the tape's) goes to every gradient call (see :func:`plain_gradients`)."""
    ys, xs, grad_ys = _as_ys(ys), _as_list(xs), _as_list(grad_ys)
    tf_gradients_kwargs = _tf_gradients_options(tf_gradients_kwargs)
    if not ys or not xs:
        # Nothing to rewrite (a model with no trainable weights, a loss of no
        # terms): what tf.gradients gives, [] or one None (or zeros) per x.
        return tf_internal.gradients_helper(ys or [], xs or [], grad_ys, name=name,
                                            **tf_gradients_kwargs)
    if stops_hold:
        tf_gradients_kwargs["stops_hold"] = True
    graph = _validate(ys, xs, grad_ys)
    compiled = compiled_by_xla(settings.xla, graph)
    if compiled:
        settings = _under_xla(settings)
    with graph.as_default():
        if _only_plain_can(ys, xs, graph):
            return plain_gradients(ys, xs, _resolve_grad_ys(grad_ys, ys, graph), name=name,
                                   **tf_gradients_kwargs)
        xs = _resolve_xs(xs, graph)
        grad_ys = _resolve_grad_ys(grad_ys, ys, graph)

        def plain():
            return plain_gradients(ys, xs, grad_ys, name=name, **tf_gradients_kwargs)

        if getattr(_rewriting, "depth", 0):
            # A gradient function that takes gradients itself (tf.recompute_grad's,
            # a custom gradient recomputing its body under a tape), run by the
            # rewrite of an enclosing call: its ops are part of that call's
            # segment, which the enclosing audit checks; a rewrite of its own
            # would interleave its segments and fences with the enclosing ones.
            logger.debug("memsave: a gradient call made while memsave rewrites another "
                         "(in a gradient function); plain tf.gradients is used for it")
            return plain()
        if tf_internal.could_possibly_record():
            # The tape would record none of the copies and give None for
            # higher-order gradients where TensorFlow gives them.
            warn_once("gradients:recording", (
                "memsave.gradients: a GradientTape is recording (e.g. for higher-order "
                "gradients); it would not see memsave's recomputed ops, so plain "
                "tf.gradients is used for this call"))
            return plain()
        with _collector_paused():
            region = analyze(ys, xs, compiled, settings.bounds_time)
            if not region.ops:
                logger.warning("memsave: none of the ys depends on the xs; gradients are None")
                return plain()
            chosen = plan_region(region, settings, compiled)
            logger.info("%s", chosen.summary())
            if _plain_is_better(chosen, settings):
                return plain()
            return _rewritten(region, chosen, settings, grad_ys, compiled, name,
                              tf_gradients_kwargs)


def _only_plain_can(ys, xs, graph):
    """Whether this call is one plain ``tf.gradients`` can take and memsave's
    rewrite cannot (a WARNING, once, says why)."""
    if reaches_xs_through_captures(ys, xs, graph):
        warn_once("gradients:captures", (
            "memsave.gradients: the ys are in a function body (a cond branch or "
            "a loop body) and read a tensor that the enclosing graph computes from "
            "an x; tf.gradients differentiates through that capture, which memsave "
            "cannot rewrite, so plain tf.gradients is used for this call"))
        return True
    if tf_internal.in_v1_while_body(graph):
        warn_once("gradients:v1-while", (
            "memsave.gradients: called inside the body of a TF1 while loop "
            "(tf.compat.v1.disable_control_flow_v2()), where memsave's copies, built "
            "outside the loop's context, could not read its tensors; plain "
            "tf.gradients is used for this call"))
        return True
    return False


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off while memsave builds, as it was after.

    Analysis, planning, the rewrite and the audit make many short-lived
    containers, and each full collection walks every object of the process,
    the graph's and the model's among them: DenseNet121's build (128 px)
    ran one or two, 0.45 s each, 6% of it. Nothing memsave builds needs a
    collection to be freed in time: what it drops goes by reference
    counting, and cycles wait for the next collection after it.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _plain_is_better(chosen, settings):
    """Whether plain ``tf.gradients`` serves the call better than ``chosen`` (logged)."""
    if not chosen.kept:
        logger.info("memsave: no checkpoints; using plain tf.gradients")
        return True
    # A budget's plan is to fit it, and a cap bounds what a plan costs; a plan
    # with neither must save more than the estimate's error to be worth its
    # recomputation.
    bounded = settings.budget is not None or settings.max_recompute is not None
    margin = 0.0 if bounded else MIN_SAVING
    if settings.fallback and settings.checkpoints.by_name and chosen.worse_than_plain(margin):
        # A named strategy is a means to save memory; an explicit list or a
        # callable is the user's own choice and is honoured.
        logger.info("memsave: the %s plan's estimated peak (%.1f MiB) is not %s plain "
                    "backprop's (%.1f MiB); using plain tf.gradients", chosen.strategy,
                    chosen.estimated_peak_bytes / 2**20,
                    "%d%% below" % round(100 * margin) if margin else "below",
                    chosen.plain_peak_bytes / 2**20)
        return True
    return False


def _rewritten(region, chosen, settings, grad_ys, compiled, name, tf_gradients_kwargs):
    """The gradients of ``region`` keeping ``chosen``, audited and checked against TF's."""
    graph = region.graph
    kept = [graph.get_tensor_by_name(n) for n in chosen.kept]
    swap = None
    if chosen.offloaded:
        model = settings.offload_model
        swap = SwapConfig(tuple(graph.get_tensor_by_name(n) for n in chosen.offloaded),
                          model.host_device, model.swapin_ahead, model.swapin_groupby)
        _say_if_offloading_is_a_no_op(swap)
    ledger = audit.Ledger(graph, stops_hold=tf_gradients_kwargs.get("stops_hold", False))
    _rewriting.depth = getattr(_rewriting, "depth", 0) + 1
    try:
        grads = rewrite(region, kept, ledger, grad_ys=grad_ys, name=name, swap=swap,
                        barriers=compiled, **tf_gradients_kwargs)
    finally:
        _rewriting.depth -= 1
    audit.check(ledger, region, grads, tf_gradients_kwargs.get("stop_gradients") or [])
    connected = differentiably_connected(region.xs, region.ys,
                                         tf_gradients_kwargs.get("stop_gradients") or [])
    grads, zero_filled = _zeros_for_unused_outputs(region.ys, region.xs, grads, grad_ys, name,
                                                   tf_gradients_kwargs, connected)
    _check_none_pattern(region.ys, region.xs, grads, grad_ys, name, tf_gradients_kwargs,
                        connected, zero_filled)
    tol = verify_module.tolerance(settings.verify, grads)
    if tol is not None:
        grads = verify_module.on_first_step(region, grad_ys, grads, tol,
                                            tf_gradients_kwargs, name)
    with graph.as_default():
        return [non_finite_throughout(g) for g in grads]


def compiled_by_xla(xla, graph):
    """Whether XLA compiles the step being built in ``graph`` (``xla`` overrides)."""
    if xla is None:
        return bool(tf_internal.graph_compiled_by_xla(graph))
    return xla


def _under_xla(settings):
    """``settings`` for a step XLA compiles: no offloading, no verify."""
    if settings.verify:
        raise ValueError(
            "memsave: verify= under XLA: the check reports a mismatch with an error message, "
            "which a compiled step (jit_compile=True) cannot raise; verify the plan with "
            "jit_compile=False (the gradients are the same), then compile")
    if settings.offload is None:
        return settings
    if settings.offload == "auto":
        logger.warning("memsave: offload='auto' under XLA: a compiled step keeps every "
                       "tensor in device memory, so the plan recomputes instead")
        return settings.replace(offload=None)
    raise ValueError("memsave: offload= under XLA: a compiled step (jit_compile=True) keeps "
                     "every tensor in device memory and cannot move checkpoints to the host; "
                     "compile without XLA to offload, or pass offload=None or 'auto'")


def _zeros_for_unused_outputs(ys, xs, grads, grad_ys, name, kwargs, connected):
    """``(grads, indices)``: ``grads`` with TensorFlow's zeros where it gives
    them for an x that no y depends on, and the indices of those xs.

    ``tf.gradients`` fills the outputs of an op it differentiates that no y
    reads with zeros, and hands those back for such an output listed as an x
    (a Split's unused half whose other half reaches the ys); memsave's
    segments return None there. Whether TensorFlow differentiates that op
    depends on every x, so where an unconnected x is one of several outputs
    of its op, ``tf.gradients`` is asked for all xs (its ops are built, and
    only the zeros taken from it run).
    """
    if kwargs.get("unconnected_gradients") == tf.UnconnectedGradients.ZERO:
        return grads, set()
    unused = [i for i, (x, g, c) in enumerate(zip(xs, grads, connected))
              if g is None and not c and len(x.op.outputs) > 1]
    if not unused:
        return grads, set()
    plain = plain_gradients(ys, xs, grad_ys, name=name + "_unused_outputs", **kwargs)
    filled = {i for i in unused if plain[i] is not None}
    return [plain[i] if i in filled else g for i, g in enumerate(grads)], filled


def _check_none_pattern(ys, xs, grads, grad_ys, name, kwargs, connected, zero_filled=()):
    """Raise unless ``grads`` is None exactly where ``tf.gradients`` gives None.

    Reachability decides most cases for free. An x that reaches a y but got
    None may still be right (an op on the path, like Floor, has no
    gradient): only then is ``tf.gradients`` asked, for those xs alone (its
    ops are built but never run). ``connected``: each x's
    :func:`differentiably_connected`; ``zero_filled`` indexes the xs that
    TensorFlow's own zeros were taken for (see :func:`_zeros_for_unused_outputs`).
    """
    if kwargs.get("unconnected_gradients") == tf.UnconnectedGradients.ZERO:
        return
    extra, doubtful = [], []
    for i, (x, g, reaches) in enumerate(zip(xs, grads, connected)):
        if i in zero_filled:
            continue
        if g is not None and not reaches:
            extra.append(x.name)
        elif g is None and reaches:
            doubtful.append(x)
    lost = []
    if doubtful:
        plain = plain_gradients(ys, doubtful, grad_ys, name=name + "_check", **kwargs)
        lost = [x.name for x, g in zip(doubtful, plain) if g is not None]
    if extra or lost:
        raise GradientMismatchError(
            "memsave: internal error, refusing to return gradients that differ from "
            "tf.gradients' (%s%s). Use tf.gradients for this graph and please report "
            "it." % ("None for %s" % ", ".join(lost) if lost else "",
                     "%sa gradient for unconnected %s" % ("; " if lost else "", ", ".join(extra))
                     if extra else ""))


def _say_if_offloading_is_a_no_op(swap):
    """Offloading only saves memory when the host is not the device itself."""
    if tf.config.list_physical_devices("GPU"):
        return
    logger.info("memsave: no GPU, so host and device memory are the same: offloading %d "
                "tensor(s) to %s inserts the swap ops but saves no memory here",
                len(swap.tensors), swap.host_device)


def gradients_memory(ys, xs, grad_ys=None, **options):
    """``gradients`` with ``checkpoints='memory'``."""
    return gradients(ys, xs, grad_ys, checkpoints="memory", **options)


def gradients_speed(ys, xs, grad_ys=None, **options):
    """``gradients`` with ``checkpoints='speed'``."""
    return gradients(ys, xs, grad_ys, checkpoints="speed", **options)


def gradients_collection(ys, xs, grad_ys=None, **options):
    """``gradients`` with ``checkpoints='collection'``."""
    return gradients(ys, xs, grad_ys, checkpoints="collection", **options)


@tf.autograph.experimental.do_not_convert
def plan(ys, xs, *, checkpoints="optimal", **options):
    """The plan :func:`gradients` would execute with these options, without rewriting anything."""
    settings = resolve(checkpoints, options, "memsave.plan")
    ys, xs = _as_ys(ys), _as_list(xs)
    if not ys or not xs:
        return Plan(settings.checkpoints.label, [], notes=["no %s: nothing to differentiate"
                                                           % ("ys" if not ys else "xs")])
    graph = _validate(ys, xs, None)
    compiled = compiled_by_xla(settings.xla, graph)
    with graph.as_default():
        region = analyze(ys, _resolve_xs(xs, graph), compiled, settings.bounds_time)
        if not region.ops:
            # As memsave.gradients: nothing to differentiate, so nothing to keep.
            return Plan(settings.checkpoints.label, [], notes=["none of the ys depends on the xs"])
        return plan_region(region, settings, compiled)
