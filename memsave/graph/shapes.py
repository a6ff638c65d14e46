"""Concrete shapes to plan with when the graph leaves dimensions unknown.

A placeholder with ``None`` axes, or Keras retracing its step with a relaxed
batch for the last, smaller batch, leaves static shapes unknown; sized as 1,
the plan is blind (a U-Net's levels all look the same size). Here TF's own
shape inference runs again, on a scratch copy of the graph (a GraphDef
import) whose data sources have concrete shapes taken from, in order:

- a ``shapes`` hint (``{tensor or name: shape}``),
- the shapes the same ``tf.function`` had when it was first traced (what
  Keras' relaxed retrace would have been sized as),
- ``batch_size``, for the leading axis of sources,
- nominal sizes, where nothing above sizes an axis: a batch of
  :data:`NOMINAL_BATCH` for the leading axis and :data:`NOMINAL_AXIS` for
  any other (height, width, sequence). Absolute sizes are then a guess,
  but relative ones, through pooling, strides, upsampling and
  concatenation, come out right, which is what choosing checkpoints needs;
  the plan's notes say so and the plan counts as sized with a guess.

The outputs of ops whose sizes depend on the data (:data:`DATA_DEPENDENT`:
``tf.where``'s indices, ``tf.boolean_mask``'s, ``tf.unique``'s values, a
segment sum's rows) are sized at their largest, from their inputs' sizes,
and inference runs again from them: a guess that errs high (a mask that
keeps every row), where the caller's rule would size them as 1. The copy is only read for its shapes;
it never runs. Dimensions still unknown afterwards (where inference fails)
are sized by the caller's rule, and said so.
"""

import collections
import logging

import tensorflow as tf

from memsave import tf_internal
from memsave.graph import optable
from memsave.graph.walk import backward_ops

logger = logging.getLogger("memsave")

# Ops that bring data into a graph: the only ones whose shapes a hint sets.
SOURCE_TYPES = frozenset({
    "Placeholder", "PlaceholderWithDefault", "IteratorGetNext", "IteratorGetNextSync",
    "OptionalGetValue",
})

# Sizes for the axes of data sources that nothing else sizes (see the module docstring).
NOMINAL_BATCH = 32    # Keras' default batch
NOMINAL_AXIS = 128

# Ops with outputs sized by the data, and the most each output can hold
# given the op's input shapes (fully defined): see _largest.
DATA_DEPENDENT = frozenset({"Where", "Unique", "UniqueV2", "UniqueWithCounts",
                            "UniqueWithCountsV2", "SegmentSum", "SegmentMean", "SegmentMax",
                            "SegmentMin", "SegmentProd", "SparseSegmentSum", "SparseSegmentMean",
                            "SparseSegmentSqrtN"})
# Rounds of inference from sized data-dependent outputs (one per chain of them).
_BOUND_ROUNDS = 4

# Shapes seen at earlier traces, per (function, xs, source tensor); bounded.
_FIRST_SEEN = collections.OrderedDict()
_FIRST_SEEN_LIMIT = 4096


# ``nominal``: some source was sized with nominal sizes (a guess).
Resolved = collections.namedtuple("Resolved", "shapes notes nominal")


def _sources(ancestors):
    """Data-source tensors among ``ancestors``, by name (resources excluded)."""
    found = {}
    for op in ancestors:
        if op.type in SOURCE_TYPES:
            for t in op.outputs:
                if t.dtype.is_floating or t.dtype.is_integer or t.dtype.is_bool or \
                        t.dtype.is_complex:
                    found[t.name] = t
    return found


def _trace_key(region):
    """Identifies one traced function across retraces; None outside tf.function.

    A retrace of the same Python function gets a new FuncGraph of the same
    name with the same variable captures, so the name plus the names of the
    xs tells one model's step from another's.
    """
    graph = region.graph
    name = getattr(graph, "name", None)
    if not name or not hasattr(graph, "captures"):
        return None
    return (name, tuple(sorted(x.name for x in region.leaf_xs)))


def _as_shape(value, what):
    try:
        shape = value if isinstance(value, tf.TensorShape) else tf.TensorShape(value)
    except (TypeError, ValueError) as e:
        raise TypeError("shapes: %s must map to a shape (a tuple of ints), got %r (%s)"
                        % (what, value, e)) from None
    return shape


def _hint_names(graph, shapes):
    """``{tensor name: TensorShape}`` from a user's ``shapes`` hint (a dict, or None;
    :mod:`memsave.settings` checked that)."""
    if shapes is None:
        return {}
    out = {}
    for key, value in shapes.items():
        if isinstance(key, str):
            try:
                t = graph.get_tensor_by_name(key)
            except (KeyError, ValueError) as e:
                raise ValueError("shapes: no tensor %r in the graph (%s)" % (key, e)) from None
        elif isinstance(key, tf.Tensor) and not isinstance(key, tf_internal.EagerTensor):
            t = key
        else:
            raise TypeError("shapes: keys must be graph tensors or tensor names, got %r"
                            % (key,))
        if t.graph is not graph:
            raise ValueError("shapes: %s is in another graph than ys" % t.name)
        shape = _as_shape(value, t.name)
        if not shape.is_compatible_with(t.shape):
            raise ValueError("shapes: %s has static shape %s, incompatible with the hint %s"
                             % (t.name, t.shape, shape))
        out[t.name] = t.shape.merge_with(shape)
    return out


def _source_hints(region, ancestors, shapes, batch_size):
    """Concrete shapes for the region's data sources, and what was assumed."""
    hints = _hint_names(region.graph, shapes)
    notes = []
    if hints:
        notes.append("sizes from shapes= for %s" % ", ".join(
            "%s %s" % (n, s) for n, s in sorted(hints.items())))
    sources = _sources(ancestors)
    key = _trace_key(region)
    from_trace, from_batch, nominal = [], [], []
    for name, t in sorted(sources.items()):
        if key is not None and t.shape.is_fully_defined():
            _remember((key, name), t.shape)
        if name in hints or t.shape.is_fully_defined() or t.shape.rank is None:
            continue
        seen = _FIRST_SEEN.get((key, name)) if key is not None else None
        if seen is not None and seen.is_compatible_with(t.shape):
            dims = seen.as_list()
            if batch_size and t.shape[0] is None and dims[0] != batch_size:
                # The data's batch is this trace's, the first trace's may not
                # be (Keras' fit at 256, then at 1024: a plan for 256).
                dims[0] = batch_size
                from_batch.append(name)
            hints[name] = tf.TensorShape(dims)
            from_trace.append("%s %s" % (name, hints[name]))
            continue
        dims = t.shape.as_list()
        if batch_size and dims and dims[0] is None:
            dims[0] = batch_size
            from_batch.append(name)
        if None in dims:
            dims = [d if d is not None else NOMINAL_AXIS if i else NOMINAL_BATCH
                    for i, d in enumerate(dims)]
            nominal.append("%s %s" % (name, dims))
        hints[name] = tf.TensorShape(dims)
    if from_trace:
        notes.append("sizes from the first trace of %s: %s" % (key[0], ", ".join(from_trace)))
    if from_batch:
        notes.append("batch_size=%d for the leading axis of %s" % (batch_size,
                                                                   ", ".join(from_batch)))
    if nominal:
        notes.append("nominal sizes (batch %d, other unknown axes %d) for %s: relative sizes "
                     "are right, absolute ones a guess; pass shapes= or batch_size= to size "
                     "them" % (NOMINAL_BATCH, NOMINAL_AXIS, ", ".join(nominal)))
    return hints, notes, bool(nominal)


def _remember(key, shape):
    if key in _FIRST_SEEN:
        return
    _FIRST_SEEN[key] = shape
    while len(_FIRST_SEEN) > _FIRST_SEEN_LIMIT:
        _FIRST_SEEN.popitem(last=False)


def _infer(region, ancestors, hints):
    """Static shapes of the region's tensors with ``hints`` set on their sources.

    The ancestors of the region are imported into a scratch graph, with each
    hinted tensor and each variable read of known shape (a resource's shape
    does not survive the export) replaced by a placeholder of that shape;
    the import runs TF's shape inference.
    """
    graph = region.graph
    keep = {op.name for op in ancestors}
    graph_def = graph.as_graph_def(add_shapes=False)
    nodes = [n for n in graph_def.node if n.name in keep]
    del graph_def.node[:]
    graph_def.node.extend(nodes)
    fixed = dict(hints)
    for op in region.ops:
        for i in op.inputs:
            if i.op.type == "ReadVariableOp" and i.shape.is_fully_defined():
                fixed.setdefault(i.name, i.shape)
    present = {n.name for n in graph_def.node}
    fixed = {n: s for n, s in fixed.items() if n.rsplit(":", 1)[0] in present}
    scratch = _imported(graph, graph_def, fixed)
    bounded, dependent = [], [op for op in ancestors if op.type in DATA_DEPENDENT]
    for _ in range(_BOUND_ROUNDS):
        largest = {}
        for op in dependent:
            for name, shape in _largest(scratch.get_operation_by_name("copy/" + op.name)):
                if name not in fixed:
                    largest[name] = shape
        if not largest:
            break
        fixed.update(largest)
        bounded += sorted(largest)
        scratch = _imported(graph, graph_def, fixed)
    out = {}
    for op in region.ops:
        for t in op.outputs:
            if t.shape.is_fully_defined():
                continue
            try:
                inferred = scratch.get_tensor_by_name("copy/" + t.name).shape
            except (KeyError, ValueError):
                continue
            if inferred.is_compatible_with(t.shape):
                out[t.name] = t.shape.merge_with(inferred)
    return out, bounded


def _imported(graph, graph_def, fixed):
    """A scratch graph of ``graph_def`` (of ``graph``'s ops), each tensor named in
    ``fixed`` replaced by a placeholder of its shape there."""
    scratch = tf.Graph()
    with scratch.as_default():
        input_map = {}
        for i, (name, shape) in enumerate(sorted(fixed.items())):
            dtype = graph.get_tensor_by_name(name).dtype
            input_map[name] = tf.compat.v1.placeholder(dtype, shape, name="memsave_hint_%d" % i)
        tf.graph_util.import_graph_def(graph_def, input_map=input_map, name="copy")
    return scratch


def _largest(op):
    """``[(original tensor name, shape)]``: the most each output of ``op`` (a
    :data:`DATA_DEPENDENT` op in the scratch graph) can hold, where its
    input's shape is known and its own is not: ``tf.where`` finds every
    element, ``tf.unique`` every value distinct, a segment reduction a
    segment per id."""
    x = op.inputs[0].shape
    if not x.is_fully_defined():
        return []
    if "Segment" in op.type:
        ids = op.inputs[2 if op.type.startswith("Sparse") else 1].shape
        if not ids.is_fully_defined() or ids.rank != 1 or x.rank < 1:
            return []
        shapes = [tf.TensorShape(ids[:1]).concatenate(x[1:])]
    elif op.type == "Where":
        shapes = [tf.TensorShape([x.num_elements(), x.rank])]
    elif op.type in ("Unique", "UniqueWithCounts"):
        shapes = [x, None, x]   # values, their indices (known), counts
    else:   # UniqueV2, UniqueWithCountsV2: along an axis, at most its length
        shapes = [x, None, tf.TensorShape(x[:1]) if x.rank == 1 else None]
    out = []
    for t, shape in zip(op.outputs, shapes):
        if shape is not None and not t.shape.is_fully_defined() and t.shape.is_compatible_with(
                shape):
            out.append((t.name[len("copy/"):], t.shape.merge_with(shape)))
    return out


def resolve(region, shapes=None, batch_size=None):
    """``Resolved(shapes, notes, nominal)``: better static shapes for region tensors.

    ``shapes`` maps tensor names to shapes at least as defined as the
    graph's; it is empty when the graph knows every shape or nothing could
    be learned. ``notes`` say where the sizes came from; ``nominal``
    whether some of them are nominal (a guess).
    """
    unknown = any(not t.shape.is_fully_defined() and not optable.kernel_sized(op, k)
                  for op in region.ops for k, t in enumerate(op.outputs))
    ancestors = backward_ops(region.ops, control=True)
    hints, notes, nominal = _source_hints(region, ancestors, shapes, batch_size)
    if not unknown or not (hints or any(op.type in DATA_DEPENDENT for op in ancestors)):
        return Resolved({}, notes if unknown else [], False)
    try:
        inferred, bounded = _infer(region, ancestors, hints)
    except Exception as e:   # pylint: disable=broad-except
        # Only sizes are lost: the plan is then sized by the old rule, and says so.
        logger.info("memsave: could not infer shapes from the hints (%s: %s)",
                    type(e).__name__, e)
        return Resolved({}, notes + ["shape inference from the hints failed (%s)"
                                     % type(e).__name__], False)
    if bounded:
        notes.append("data-dependent sizes taken at their largest (every element found, "
                     "every value distinct, a segment per id) for %s: the estimate errs "
                     "high there"
                     % ", ".join(bounded))
    return Resolved(inferred, notes, nominal or bool(bounded))
