"""Public entry points: drop-in replacements for ``tf.gradients``."""

import logging

import tensorflow as tf

from memsave import tf_internal
from memsave import verify as verify_module
from memsave.errors import GradientMismatchError
from memsave.log import warn_once
from memsave.planning import registry
from memsave.planning import strategies as planning
from memsave.planning.offload import DEFAULT_DEVICE_FLOPS, DEFAULT_HOST_BANDWIDTH, OffloadModel
from memsave.planning.plan import Plan
from memsave.graph import audit, graph_tensor
from memsave.graph.region import analyze, to_plan_graph
from memsave.graph.shapes import resolve as resolve_shapes
from memsave.graph.walk import differentiably_connected
from memsave.rewrite import SwapConfig, plain_gradients, rewrite

logger = logging.getLogger("memsave")

# Names that are not planning-graph strategies: they need the TF graph.
COLLECTION = "collection"
STRATEGIES = ("optimal", "memory", "speed", COLLECTION)   # the built-in names


def strategy_names():
    """Every name ``checkpoints=`` accepts: built-ins, 'collection', registered ones."""
    names = registry.strategy_names()
    return names[:len(registry.BUILT_IN)] + [COLLECTION] + names[len(registry.BUILT_IN):]


def check_checkpoints(checkpoints):
    """Raise unless ``checkpoints`` is a strategy name, a callable strategy or a list."""
    if isinstance(checkpoints, str):
        if checkpoints != COLLECTION and registry.lookup(checkpoints) is None:
            raise ValueError("unknown checkpoints strategy %r; use one of %s, a callable "
                             "strategy or a list of tensors" % (
                                 checkpoints, ", ".join(map(repr, strategy_names()))))
    elif not callable(checkpoints) and not isinstance(checkpoints, (list, tuple)):
        raise TypeError("checkpoints must be a strategy name (%s), a callable strategy or a "
                        "list of tensors, got %r" % (", ".join(strategy_names()), checkpoints))

# What ``fallback=None`` means. memsave's own test suite turns it off to
# check the rewrite itself on graphs too small for it to pay.
FALLBACK_TO_PLAIN = True


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
    constant, whose gradients are then unconnected.
    """
    ys = _as_list(ys)
    if not ys:
        return ys
    graphs = [y.graph for y in ys if isinstance(y, (tf.Tensor, tf.IndexedSlices))
              and not isinstance(y, tf_internal.EagerTensor)]
    graph = graphs[0] if graphs else tf.compat.v1.get_default_graph()
    out = []
    with graph.as_default():
        for y in ys:
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
    if not ys:
        raise ValueError("memsave.gradients: ys is empty")
    if not xs:
        raise ValueError("memsave.gradients: xs is empty; pass the tensors or variables "
                         "to differentiate with respect to")
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


def _explicit_checkpoints(items, graph, region):
    tensors = []
    for t in items:
        if isinstance(t, tf.Operation) or not isinstance(t, tf.Tensor):
            raise TypeError("checkpoints must be tf.Tensor objects, got %r" % (t,))
        if t.graph is not graph:
            raise ValueError("checkpoint %s is in another graph than ys" % t.name)
        tensors.append(t)
    ends = {t.ref() for t in region.leaf_xs} | {t.ref() for t in region.ys}
    for t in tensors:
        if t.ref() in ends and t.op not in region.ops:   # region ys: see planning.explicit
            logger.debug("memsave: checkpoint %s is an x or a y; ignored", t.name)
    off_path = [t.name for t in tensors if t.op not in region.ops and t.ref() not in ends]
    if off_path:
        logger.warning("memsave: %d checkpoint(s) are not between xs and ys and are not used: %s",
                       len(off_path), ", ".join(off_path))
    return [t.name for t in tensors if t.op in region.ops]


def _offload_model(swapin_ahead, host_bandwidth, device_flops):
    if not isinstance(swapin_ahead, int) or swapin_ahead < 0:
        raise ValueError("swapin_ahead must be an int >= 0, got %r" % (swapin_ahead,))
    return OffloadModel(host_bandwidth=host_bandwidth, device_flops=device_flops,
                        prefetch=swapin_ahead > 0)


def _offload_names(offload, region):
    """Tensor names a user asked to offload, or a clear error."""
    names = []
    for t in offload:
        if not isinstance(t, tf.Tensor) or isinstance(t, tf_internal.EagerTensor):
            raise TypeError("offload must be 'auto' or a list of graph tensors, got %r" % (t,))
        if t.graph is not region.graph:
            raise ValueError("offloaded tensor %s is in another graph than ys" % t.name)
        names.append(t.name)
    return names


def make_plan(region, checkpoints, min_checkpoint_size=1024, budget=None, batch_size=None,
              offload=None, offload_model=None, shapes=None, max_recompute=None,
              compiled=False):
    """Run a strategy on the region; return a :class:`memsave.Plan`.

    ``checkpoints`` is a registered name ('optimal', ...), 'collection', a
    callable strategy (see :mod:`memsave.planning.registry`) or a list of
    tensors. ``offload`` is None, 'auto' or a list of tensors to keep in
    host memory (see :mod:`memsave.planning.offload`). ``shapes`` and
    ``batch_size`` size what the graph leaves unknown (see
    :mod:`memsave.graph.shapes`). ``compiled``: XLA compiles the step, so
    the plan sees XLA's fusions (see :func:`memsave.graph.region.to_plan_graph`).
    """
    check_checkpoints(checkpoints)
    strategy = _strategy(checkpoints)
    if strategy is not None:
        registry.check_options(strategy, repr(checkpoints) if isinstance(checkpoints, str)
                               else registry.label(strategy),
                               dict(budget=budget, max_recompute=max_recompute))
    elif budget is not None or max_recompute is not None:
        raise ValueError("%s= needs checkpoints='optimal' or a strategy that accepts it; got %s"
                         % ("budget" if budget is not None else "max_recompute",
                            "a list of tensors" if not isinstance(checkpoints, str)
                            else repr(checkpoints)))
    if isinstance(offload, str) and offload != "auto":
        raise ValueError("offload must be None, 'auto' or a list of tensors, got %r" % (offload,))
    if offload is not None and not isinstance(offload, (str, list, tuple)):
        raise TypeError("offload must be None, 'auto' or a list of tensors, got %r" % (offload,))
    names = _offload_names(offload, region) if isinstance(offload, (list, tuple)) else []
    resolved = resolve_shapes(region, shapes, batch_size)
    pg = to_plan_graph(region, batch_size=batch_size, shapes=resolved.shapes,
                       compiled=compiled).validate()
    unknown = pg.unknown_dims
    model = offload_model or OffloadModel()
    auto = "auto" if offload == "auto" else None
    if strategy is not None:
        result = registry.run(strategy, pg, budget=budget, max_recompute=max_recompute,
                              min_checkpoint_size=min_checkpoint_size, offload=auto, model=model)
    else:
        result = planning.explicit(pg, _listed_checkpoints(region, checkpoints),
                                   strategy=checkpoints if isinstance(checkpoints, str) else "list")
        if auto:
            result = planning.with_offload(pg, result, None, model)
    if names:
        refused = [n for n in names if not pg.has_node(n) or not pg.nodes[n]["offloadable"]]
        if refused:
            raise ValueError(
                "cannot offload %s: only float tensors between xs and ys that are not ys, "
                "xs or variable reads, and that no op kept in place (stateful) reads, can wait "
                "in host memory" % ", ".join(refused))
        result = planning.with_offload(pg, result, names, model)
    result.notes.extend(resolved.notes)
    result.unknown_dims = unknown
    if unknown:
        note = "%d tensor(s) still have unknown dimensions, taken as %s for sizes" % (
            unknown, "batch_size=%d" % batch_size if batch_size else "1")
        result.notes.append(note)
        # Loud when nothing sized them; data-dependent shapes (tf.where) stay
        # unknown even with hints.
        log = logger.info if resolved.notes else logger.warning
        log("memsave: %s; the plan may keep the wrong tensors: pass shapes= "
            "(e.g. {input: (8, 128, 128, 3)}) or batch_size=", note)
    return result


def _strategy(checkpoints):
    """The planning-graph strategy ``checkpoints`` names or is; None for tensor lists."""
    if isinstance(checkpoints, str):
        return None if checkpoints == COLLECTION else registry.lookup(checkpoints)
    return checkpoints if callable(checkpoints) else None


def _listed_checkpoints(region, checkpoints):
    """Names of the tensors in ``checkpoints`` (a list) or the 'checkpoints' collection."""
    items = region.graph.get_collection("checkpoints") if checkpoints == COLLECTION \
        else checkpoints
    return _explicit_checkpoints(items, region.graph, region)


# Graph rewriting is plain Python: autograph must not convert it when it is
# called inside a tf.function.
@tf.autograph.experimental.do_not_convert
def gradients(ys, xs, grad_ys=None, checkpoints="collection", *, min_checkpoint_size=1024,
              budget=None, max_recompute=None, batch_size=None, shapes=None, offload=None,
              swapin_ahead=1, swapin_groupby=5,
              host_device="/device:CPU:0", host_bandwidth=DEFAULT_HOST_BANDWIDTH,
              device_flops=DEFAULT_DEVICE_FLOPS, fallback=None, verify=None, xla=None,
              name="gradients", **tf_gradients_kwargs):
    """Like ``tf.gradients``, but recomputes forward activations to save memory.

    ``checkpoints`` is 'optimal', 'memory', 'speed', 'collection' (tensors
    added to the graph's 'checkpoints' collection), a list of tensors to
    keep, or a strategy: any callable over the planning graph, or a name
    given to one with :func:`memsave.register_strategy` (see
    :mod:`memsave.planning.registry` and :mod:`memsave.planning.policies`).
    With 'optimal', ``budget`` (bytes, or a fraction of the plain peak
    when below 1) asks for the plan that fits it with the least recompute,
    and ``max_recompute`` (a fraction of one forward pass's work) for the
    lowest peak that recomputes at most that much.
    Dimensions the graph leaves unknown are sized from ``shapes`` (``{tensor
    or name: shape}`` for inputs), else from the shapes the same tf.function
    had when first traced, else ``batch_size`` for the leading axis of
    inputs; TF's shape inference carries them through the graph.

    ``offload`` ('auto' or a list of tensors) keeps checkpoints in host
    memory (``host_device``) between the forward and the backward pass
    instead of on the device; each swap-in starts ``swapin_ahead`` backward
    ops early and is shared by uses at most ``swapin_groupby`` ops apart.
    With 'auto', 'optimal' weighs per tensor keeping, recomputing and
    offloading (``host_bandwidth`` bytes/s against ``device_flops``); other
    strategies offload every checkpoint they keep.

    With ``fallback`` (the default), a named strategy whose estimated peak,
    on fully known sizes, is not below plain backprop's returns plain
    ``tf.gradients`` instead (logged at INFO); an explicit list of tensors
    and a callable strategy are always honoured.

    ``verify=True`` (or a tolerance) also runs plain backprop on the first
    run of the graph and fails that run if the gradients differ by more
    than the tolerance relative to the largest entry (see
    :mod:`memsave.verify`); later runs cost nothing extra.

    ``xla`` says whether XLA compiles the step: None (the default) tells
    from the trace (``tf.function(jit_compile=True)``, Keras
    ``jit_compile=True``). Under XLA each recomputed segment reads its
    inputs through an optimization barrier, as ``jax.checkpoint`` does, so
    that XLA neither merges the recomputation back into the forward pass
    nor runs it early; outside XLA the barriers would only add ops. Offloading
    needs host memory, which a compiled step cannot address: ``offload=``
    a list is refused and 'auto' plans without it.

    Further keyword arguments (``gate_gradients``, ``aggregation_method``,
    ``stop_gradients``, ``unconnected_gradients``,
    ``colocate_gradients_with_ops``) mean what they mean for ``tf.gradients``.
    Works in a ``tf.compat.v1`` Graph and inside ``tf.function``.
    """
    ys = _as_ys(ys)
    xs = _as_list(xs)
    tf_gradients_kwargs = _tf_gradients_options(tf_gradients_kwargs)
    grad_ys = _as_list(grad_ys)
    graph = _validate(ys, xs, grad_ys)
    verify_module.check_option(verify)
    compiled = compiled_by_xla(xla, graph)
    if compiled:
        offload = _offload_under_xla(offload)
        _refuse_verify_under_xla(verify)
    with graph.as_default():
        xs = _resolve_xs(xs, graph)
        grad_ys = _resolve_grad_ys(grad_ys, ys, graph)
        if tf_internal.could_possibly_record():
            # The tape would record none of the copies and give None for
            # higher-order gradients where TensorFlow gives them.
            warn_once("gradients:recording", (
                "memsave.gradients: a GradientTape is recording (e.g. for higher-order "
                "gradients); it would not see memsave's recomputed ops, so plain "
                "tf.gradients is used for this call"))
            return plain_gradients(ys, xs, grad_ys, name=name, **tf_gradients_kwargs)
        region = analyze(ys, xs)
        if not region.ops:
            logger.warning("memsave: none of the ys depends on the xs; gradients are None")
            return plain_gradients(ys, xs, grad_ys, name=name, **tf_gradients_kwargs)
        if not isinstance(swapin_groupby, int) or swapin_groupby < 0:
            raise ValueError("swapin_groupby must be an int >= 0, got %r" % (swapin_groupby,))
        chosen = make_plan(region, checkpoints, min_checkpoint_size, budget, batch_size,
                           offload, _offload_model(swapin_ahead, host_bandwidth, device_flops),
                           shapes=shapes, max_recompute=max_recompute, compiled=compiled)
        logger.info("%s", chosen.summary())
        kept = [graph.get_tensor_by_name(n) for n in chosen.kept]
        if not kept:
            logger.info("memsave: no checkpoints; using plain tf.gradients")
            return plain_gradients(ys, xs, grad_ys, name=name, **tf_gradients_kwargs)
        if fallback is None:
            fallback = FALLBACK_TO_PLAIN
        if fallback and chosen.worse_than_plain() and isinstance(checkpoints, str):
            # A named strategy is a means to save memory; an explicit list is
            # the user's own choice and is honoured.
            logger.info("memsave: the %s plan's estimated peak (%.1f MB) is not below plain "
                        "backprop's (%.1f MB); using plain tf.gradients", chosen.strategy,
                        chosen.estimated_peak_bytes / 2**20, chosen.plain_peak_bytes / 2**20)
            return plain_gradients(ys, xs, grad_ys, name=name, **tf_gradients_kwargs)
        swap = None
        if chosen.offloaded:
            swap = SwapConfig(tuple(graph.get_tensor_by_name(n) for n in chosen.offloaded),
                              host_device, swapin_ahead, swapin_groupby)
            _say_if_offloading_is_a_no_op(swap)
        ledger = audit.Ledger(graph)
        grads = rewrite(region, kept, ledger, grad_ys=grad_ys, name=name, swap=swap,
                        barriers=compiled, **tf_gradients_kwargs)
        audit.check(ledger, region, grads, tf_gradients_kwargs.get("stop_gradients") or [])
        _check_none_pattern(ys, xs, grads, grad_ys, name, tf_gradients_kwargs)
        tol = verify_module.tolerance(verify, grads)
        if tol is not None:
            grads = verify_module.on_first_step(region, grad_ys, grads, tol,
                                                tf_gradients_kwargs, name)
        return grads


def check_xla(xla):
    """Raise unless ``xla`` is None (tell from the trace), True or False."""
    if xla is not None and not isinstance(xla, bool):
        raise TypeError("xla must be None (tell from the trace), True or False, got %r"
                        % (xla,))


def compiled_by_xla(xla, graph):
    """Whether XLA compiles the step being built in ``graph`` (``xla`` overrides)."""
    check_xla(xla)
    if xla is None:
        return bool(tf_internal.graph_compiled_by_xla(graph))
    return xla


def _offload_under_xla(offload):
    if offload is None:
        return None
    if offload == "auto":
        logger.warning("memsave: offload='auto' under XLA: a compiled step keeps every "
                       "tensor in device memory, so the plan recomputes instead")
        return None
    raise ValueError("memsave: offload= under XLA: a compiled step (jit_compile=True) keeps "
                     "every tensor in device memory and cannot move checkpoints to the host; "
                     "compile without XLA to offload, or pass offload=None or 'auto'")


def _refuse_verify_under_xla(verify):
    if verify is not None and verify is not False:
        raise ValueError(
            "memsave: verify= under XLA: the check reports a mismatch with an error message, "
            "which a compiled step (jit_compile=True) cannot raise; verify the plan with "
            "jit_compile=False (the gradients are the same), then compile")


def _check_none_pattern(ys, xs, grads, grad_ys, name, kwargs):
    """Raise unless ``grads`` is None exactly where ``tf.gradients`` gives None.

    Reachability decides most cases for free. An x that reaches a y but got
    None may still be right (an op on the path, like Floor, has no
    gradient): only then is ``tf.gradients`` asked, for those xs alone (its
    ops are built but never run).
    """
    if kwargs.get("unconnected_gradients") == tf.UnconnectedGradients.ZERO:
        return
    stops = kwargs.get("stop_gradients") or []
    extra, doubtful = [], []
    for x, g, connected in zip(xs, grads, differentiably_connected(xs, ys, stops)):
        if g is not None and not connected:
            extra.append(x.name)
        elif g is None and connected:
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


def gradients_memory(ys, xs, grad_ys=None, **kwargs):
    """``gradients`` with ``checkpoints='memory'``."""
    return gradients(ys, xs, grad_ys, checkpoints="memory", **kwargs)


def gradients_speed(ys, xs, grad_ys=None, **kwargs):
    """``gradients`` with ``checkpoints='speed'``."""
    return gradients(ys, xs, grad_ys, checkpoints="speed", **kwargs)


def gradients_collection(ys, xs, grad_ys=None, **kwargs):
    """``gradients`` with ``checkpoints='collection'``."""
    return gradients(ys, xs, grad_ys, checkpoints="collection", **kwargs)


@tf.autograph.experimental.do_not_convert
def plan(ys, xs, checkpoints="optimal", min_checkpoint_size=1024, budget=None, batch_size=None,
         offload=None, swapin_ahead=1, host_bandwidth=DEFAULT_HOST_BANDWIDTH,
         device_flops=DEFAULT_DEVICE_FLOPS, shapes=None, max_recompute=None, xla=None):
    """The plan a strategy would execute, without rewriting anything."""
    ys = _as_ys(ys)
    xs = _as_list(xs)
    graph = _validate(ys, xs, None)
    compiled = compiled_by_xla(xla, graph)
    with graph.as_default():
        region = analyze(ys, _resolve_xs(xs, graph))
        if not region.ops:
            # As memsave.gradients: nothing to differentiate, so nothing to keep.
            check_checkpoints(checkpoints)
            label = (checkpoints if isinstance(checkpoints, str) else
                     registry.label(checkpoints) if callable(checkpoints) else "list")
            return Plan(label, [],
                        notes=["none of the ys depends on the xs"])
        return make_plan(region, checkpoints, min_checkpoint_size, budget, batch_size, offload,
                         _offload_model(swapin_ahead, host_bandwidth, device_flops),
                         shapes=shapes, max_recompute=max_recompute, compiled=compiled)
