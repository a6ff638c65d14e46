"""The front of planning: a differentiated region and :class:`~memsave.settings.Settings` in,
a :class:`memsave.Plan` out.

The only place that turns the TensorFlow side (the region, the tensors a
user listed) into what the framework-free planners take: a
:class:`~memsave.planning.dag.PlanGraph` sized by shape inference, and
tensor names. Which tensors to keep is decided in :mod:`memsave.planning`.
"""

import logging

import tensorflow as tf

from memsave import budget, tf_internal
from memsave.errors import BudgetError
from memsave.graph.region import to_plan_graph
from memsave.graph.shapes import resolve as resolve_shapes
from memsave.planning import registry
from memsave.planning import strategies

logger = logging.getLogger("memsave")

SIZES_NOTE = ("; the sizes were nominal (the batch or another axis is unknown where the "
              "step is traced, e.g. a tf.data batch without drop_remainder): pass "
              "batch_size= or shapes= to plan on the step's sizes")


def plan_region(region, settings, compiled=False):
    """The plan ``settings`` ask for on ``region`` (see :func:`memsave.plan`).

    ``compiled``: XLA compiles the step, so the plan sees XLA's fusions
    (see :func:`memsave.graph.region.to_plan_graph`).
    """
    offload_names = _offload_names(settings.offload, region)
    resolved = resolve_shapes(region, settings.shapes, settings.batch_size)
    graph = to_plan_graph(region, batch_size=settings.batch_size, shapes=resolved.shapes,
                          compiled=compiled).validate()
    loop = budget.active()
    try:
        chosen = _choose_in_budget(graph, region, settings, loop)
    except BudgetError as error:
        if budget.is_bytes(settings.budget) and (resolved.nominal or graph.unknown_dims):
            # Sizes guessed for unknown axes give relative sizes, not the
            # step's bytes: a budget in bytes needs the real batch.
            error.sizes_note = SIZES_NOTE
            error.args = (str(error) + SIZES_NOTE,) + error.args[1:]
        raise
    if offload_names:
        _check_offloadable(graph, offload_names)
        chosen = strategies.with_offload(graph, chosen, offload_names, settings.offload_model)
    if loop is not None:
        loop.record(chosen)
    chosen.notes.extend(resolved.notes)
    # Tensors sized with a guess: still unknown, or sized from nominal sizes.
    chosen.unknown_dims = graph.unknown_dims + (len(resolved.shapes) if resolved.nominal else 0)
    if graph.unknown_dims:
        _say_unknown_dims(chosen, graph.unknown_dims, settings.batch_size, resolved.notes)
    return chosen


def _choose_in_budget(graph, region, settings, loop):
    """:func:`_choose`, told by a budget ``loop`` (see :mod:`memsave.budget`) what
    a byte budget means for the estimate; where nothing fits the loop's target
    but the lowest plan would fit the budget itself, the lowest plan."""
    if loop is None:
        return _choose(graph, region, settings)
    try:
        return _choose(graph, region, loop.planning(settings, graph))
    except BudgetError as error:
        loop.unfit(error)
        if not loop.takes_lowest():
            raise
        return _choose(graph, region, settings.replace(budget=None))


def _choose(graph, region, settings):
    checkpoints = settings.checkpoints
    if checkpoints.strategy is not None:
        return registry.run(checkpoints.strategy, graph, **settings.strategy_options())
    items = (region.graph.get_collection("checkpoints") if checkpoints.from_collection
             else checkpoints.tensors)
    chosen = strategies.explicit(graph, _listed_names(items, region), checkpoints.label)
    if settings.offload == "auto":
        chosen = strategies.with_offload(graph, chosen, None, settings.offload_model)
    return chosen


def _listed_names(items, region):
    """Names of the listed tensors that lie between xs and ys (the others are reported)."""
    graph = region.graph
    for t in items:
        if isinstance(t, tf.Operation) or not isinstance(t, tf.Tensor):
            raise TypeError("checkpoints must be tf.Tensor objects, got %r" % (t,))
    items = _in_graph(items, graph)
    for t in items:
        if t.graph is not graph:
            raise ValueError("checkpoint %s is in another graph than ys" % t.name)
    ends = {t.ref() for t in region.leaf_xs} | {t.ref() for t in region.ys}
    for t in items:
        if t.ref() in ends and t.op not in region.ops:   # region ys: see strategies.explicit
            logger.debug("memsave: checkpoint %s is an x or a y; ignored", t.name)
    off_path = [t.name for t in items if t.op not in region.ops and t.ref() not in ends]
    if off_path:
        logger.warning("memsave: %d checkpoint(s) are not between xs and ys and are not used: %s",
                       len(off_path), ", ".join(off_path))
    return [t.name for t in items if t.op in region.ops]


def _in_graph(items, graph):
    """``items`` with each eager tensor that ``graph`` (a tf.function's) captured
    replaced by its placeholder there; one it did not capture cannot lie
    between xs and ys, and is reported and left out."""
    captured = {id(outer): inner for outer, inner in getattr(graph, "captures", ())}
    out, missing = [], []
    for t in items:
        if not isinstance(t, tf_internal.EagerTensor):
            out.append(t)
        elif id(t) in captured:
            out.append(captured[id(t)])
        else:
            missing.append("an eager %s tensor of shape %s" % (t.dtype.name, t.shape))
    if missing:
        logger.warning("memsave: %d checkpoint(s) are eager tensors this graph does not read, "
                       "so not between xs and ys, and are not used: %s",
                       len(missing), ", ".join(missing))
    return out


def _offload_names(offload, region):
    """Tensor names a user asked to offload, or a clear error."""
    if not isinstance(offload, tuple):
        return []
    names = []
    for t in offload:
        if not isinstance(t, tf.Tensor) or isinstance(t, tf_internal.EagerTensor):
            raise TypeError("offload must be 'auto' or a list of graph tensors, got %r" % (t,))
        if t.graph is not region.graph:
            raise ValueError("offloaded tensor %s is in another graph than ys" % t.name)
        names.append(t.name)
    return names


def _check_offloadable(graph, names):
    refused = [n for n in names if not graph.has_node(n) or not graph.nodes[n]["offloadable"]]
    if refused:
        raise ValueError(
            "cannot offload %s: only float tensors between xs and ys that are not ys, "
            "xs or variable reads, and that no op kept in place (stateful) reads, can wait "
            "in host memory" % ", ".join(refused))


def _say_unknown_dims(chosen, unknown, batch_size, size_notes):
    note = "%d tensor(s) still have unknown dimensions, taken as %s for sizes" % (
        unknown, "batch_size=%d" % batch_size if batch_size else "1")
    chosen.notes.append(note)
    # Loud when nothing sized them; data-dependent shapes (tf.where) stay
    # unknown even with hints.
    log = logger.info if size_notes else logger.warning
    log("memsave: %s; the plan may keep the wrong tensors: pass shapes= "
        "(e.g. {input: (8, 128, 128, 3)}) or batch_size=", note)
