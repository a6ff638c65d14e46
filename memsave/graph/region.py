"""The forward region between ``xs`` and ``ys`` and its planning graph.

The region is every op on a path from an ``x`` to a ``y``: the ops a
checkpointed backward pass may recompute. ``to_plan_graph`` exports it as a
framework-free :class:`~memsave.planning.dag.PlanGraph` of tensors, which is
all the planners see; op types become neutral flags through
:mod:`memsave.graph.optable`.
"""

import collections
import dataclasses
import logging

import tensorflow as tf

from memsave import tf_internal

from memsave.errors import V1ControlFlowError
from memsave.graph import compiled_calls, functions, optable
from memsave.graph.optable import grad_reads
from memsave.graph.stateful import BufferFacts, is_pinned, written_handles
from memsave.graph.walk import backward_ops, carries_gradient, forward_ops, topo_order
from memsave.planning.dag import PlanGraph

logger = logging.getLogger("memsave")

def differentiable(t):
    return t.dtype.is_floating or t.dtype.is_complex


@dataclasses.dataclass
class Region:
    """Ops between ``xs`` and ``ys``, in a deterministic topological order."""

    graph: tf.Graph
    ys: list
    xs: list
    order: list            # region ops, topological
    ops: set               # the same, as a set
    pinned: set            # region ops that must never be recomputed
    forced: list           # tensors that must be checkpoints because of pinned ops

    @property
    def copyable(self):
        return self.ops - self.pinned

    @property
    def leaf_xs(self):
        """The xs not computed inside the region (from other xs)."""
        return [x for x in self.xs if x.op not in self.ops]

    def tensors(self):
        """Region op outputs in topological order."""
        return [t for op in self.order for t in op.outputs]


def has_gradient(op):
    """True if TensorFlow can backprop through ``op``."""
    try:
        return tf_internal.get_gradient_function(op) is not None
    except LookupError:
        return False


# The ops of TF1 control flow (tf.compat.v1.disable_control_flow_v2()).
V1_CONTROL_FLOW = frozenset({
    "Switch", "RefSwitch", "Merge", "RefMerge", "Enter", "RefEnter", "Exit", "RefExit",
    "NextIteration", "RefNextIteration", "LoopCond",
})
# The ops of a TF1 TensorArray (TensorArrayV3, TensorArrayReadV3, ...; control
# flow v2 builds TensorLists instead).
V1_TENSOR_ARRAY = "TensorArray"


def _is_v1_control_flow(op):
    return op.type in V1_CONTROL_FLOW or op.type.startswith(V1_TENSOR_ARRAY)


def _without_gradientless_v1_control_flow(ops, starts, ys):
    """``ops`` on a path from an x to a y that gradients pass along, where TF1 control
    flow is among them (a loop over ``tf.stop_gradient(h)`` or over an
    ``argmax`` index, ``Optimizer.minimize`` of such a model under
    :func:`memsave.patch`). Their outputs are read where the forward pass
    computed them, as the region's other inputs (a weight) are: nothing of
    them is copied, and backprop stops at them as plain's does, where its
    last gradient-carrying edge ends. TF1 control flow a gradient passes
    through stays, and is refused (:func:`_refuse_v1_control_flow`). ys that
    only such control flow connects to the xs leave no region: their
    gradients are None, as plain's are."""
    if not any(_is_v1_control_flow(op) for op in ops):
        return ops
    reached = forward_ops(starts, within=ops,
                          leaves=lambda t: carries_gradient(t) and has_gradient(t.op))
    if any(_is_v1_control_flow(op) for op in reached):
        return ops
    kept = backward_ops([y.op for y in ys], within=reached)
    logger.debug("memsave: TF1 control flow that no gradient reaches is left out of the "
                 "region with %d other op(s) no gradient passes along", len(ops) - len(kept))
    return kept


def _refuse_v1_control_flow(ops):
    """Raise on TF1 control flow: copying it needs its control-flow contexts.

    A v1 ``cond`` or ``while_loop`` is a web of Switch/Merge/Enter/Exit ops
    tied together by Python context objects; a copy of some of its ops is not
    a valid construct (a copied cond loses its branch gradients, a while loop
    is a cycle). Wrong or missing gradients are worse than none.

    A TF1 ``TensorArray`` (``TensorArrayV3`` and its reads and writes)
    sends its gradients through a gradient TensorArray that TensorFlow looks
    up by the name scope of the ``tf.gradients`` call; each of memsave's
    segments is a call of its own, so the writes of one went to another
    array than the reads of the next (gradients 0.18-0.92 of the largest
    entry off plain's, with no error).
    """
    found = sorted({op.type for op in ops if _is_v1_control_flow(op)})
    if found:
        raise V1ControlFlowError(
            "memsave cannot recompute TF1 control flow that a gradient passes through "
            "(found %s ops between xs and ys, from "
            "tf.compat.v1.disable_control_flow_v2() or a graph built "
            "without control flow v2). Build the graph with control flow v2 "
            "(tf.compat.v1.enable_control_flow_v2(), the TF2 default) or use "
            "tf.gradients for this graph." % ", ".join(found))


def pinned_under_xla(op):
    """Whether XLA cannot compile a recomputation of ``op``: a cond or a case.

    A cond's gradient reads integers its forward branches computed (a
    gather's ``dense_shape``, a reshape's shape) as outputs of the forward
    op, and XLA needs some of them as compile-time constants: it evaluates
    them through the op's inputs, and a recomputed copy reads its inputs
    through an optimization barrier, which XLA's evaluator does not
    implement ("HloEvaluator does not implement the opt-barrier opcode ...
    input 2 of UnsortedSegmentSum as a compile-time constant"). Kept where
    they run, they read what plain backprop reads.
    """
    return functions.is_cond(op)


def pinned_on_cpu(op, compiled):
    """Whether ``op`` is a call XLA compiles on its own (in a step it does not
    compile) on a CPU: where the caller bounds the step's time, memsave
    differentiates it in place, as plain backprop does, and never
    recomputes it.

    A call's gradient reads the intermediates the call itself outputs, so
    a copy of it runs in its segment whatever the plan keeps. Keras compiles
    grouped convolutions into such calls, since TensorFlow's CPU kernels
    cannot group, and XLA's CPU convolution runs them at about 1 GFLOP/s
    (see :data:`GROUPED_CONV_ON_CPU`): copied, ConvNeXtTiny's 18 reran in
    every plan, a quarter of a step (1.24-1.30x plain's step time under
    ``max_recompute=0.05``). In place, their inputs are kept until their
    gradients: the lowest plan measured 366 MiB against 309 (plain: 718),
    so the lowest-peak strategies and budgets still copy them.
    """
    return not compiled and compiled_calls.is_compiled_call(op) and _on_cpu(op.device)


def analyze(ys, xs, compiled=False, bounds_time=False):
    """Find the region between graph tensors ``xs`` and ``ys``.

    An x computed from another x (``tf.gradients(loss, [x, tanh(x)])``) is
    part of the region and a forced checkpoint: like ``tf.gradients``, its
    gradient is the total one, and it carries on to the xs below it.
    ``compiled``: XLA compiles the step (see :func:`pinned_under_xla`).
    ``bounds_time``: the caller bounds the step's time (see
    :func:`pinned_on_cpu`).
    """
    graph = ys[0].graph
    behind_ys = backward_ops([y.op for y in ys])
    starts = [c for x in xs for c in x.consumers() if c in behind_ys]
    ops = _without_gradientless_v1_control_flow(forward_ops(starts, within=behind_ys), starts,
                                                ys)
    _refuse_v1_control_flow(ops)
    order = topo_order(ops)
    written = written_handles(graph, ops) if ops else {}
    facts = BufferFacts()
    pinned = {op for op in order
              if is_pinned(op, written, facts) or (compiled and pinned_under_xla(op))
              or (bounds_time and pinned_on_cpu(op, compiled))}
    forced, seen = [], set()

    def force(t):
        if t.ref() not in seen:
            seen.add(t.ref())
            forced.append(t)

    for x in xs:
        if x.op in ops:
            force(x)
    for op in order:
        if op in pinned:
            for t in op.outputs:
                force(t)
    for op in in_place_closure([op for op in order if op in pinned and has_gradient(op)], ops):
        # Backprop runs through the original op, so its region inputs
        # must be kept, and the backward walk must stop there: every
        # input TF backpropagates through, a loop's TensorList (variant)
        # as much as a float tensor.
        for t in op.inputs:
            if t.op in ops and carries_gradient(t):
                force(t)
    if pinned:
        logger.debug("memsave: %d op(s) are never recomputed: %s", len(pinned),
                     ", ".join(sorted(op.name for op in pinned))[:500])
    return Region(graph, list(ys), list(xs), order, ops, pinned, forced)


def in_place_closure(in_place, region_ops):
    """``in_place`` (ops differentiated where they are, never copied) and the
    function calls in ``region_ops`` that feed them, transitively.

    ``tf.gradients`` differentiates a function call even when its output is
    in ``stop_gradients``: wherever an op is differentiated in place, a call
    producing one of its inputs is differentiated in the same gradient call,
    so it is in place there too. Returns them in the order found.
    """
    out, seen, stack = [], set(), list(in_place)
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        out.append(op)
        stack.extend(t.op for t in op.inputs
                     if t.op in region_ops and tf_internal.is_function_call(t.op))
    return out


def num_elements(shape, unknown_dim=1):
    """Element count with unknown dimensions taken as ``unknown_dim``; None if rank unknown."""
    if shape.rank is None:
        return None
    n = 1
    for d in shape.as_list():
        n *= d if d is not None else unknown_dim
    return n


# Work in FLOP-equivalents, per op kind: a matmul's or convolution's FLOPs,
# and for every op the bytes it reads and writes, at a price per byte that
# depends on what bounds it. Measured by ``benchmarks/op_rates.py`` (TF 2.21,
# float32, the CI CPU): in the zoo's forward passes matmuls and convolutions
# run at about the same FLOP rate, and an op that is neither is bound by its
# memory traffic: a least-squares fit of the models' times gives 9-17 FLOPs'
# time per byte over runs (the small CNNs' times vary). The model takes 6,
# lower, at which the zoo's recompute caps hold their step time; alone, softmax
# moves a byte 1.5x slower than an elementwise op. With these prices one
# rate of work per second fits the models within 1.5-1.7x (a flat 2.5 per
# byte: 2.3-2.5x, elementwise-heavy models running slower than modeled).
# Under XLA an op fused into its readers costs nothing to recompute
# (``fused_under_xla``).
BYTE_COST = {"dense": 2.5, "softmax": 9.0, "other": 6.0}
# A grouped convolution (each output channel reads a group of the input's:
# ConvNeXt's 7x7 depthwise ones) on a CPU costs this many times its FLOPs.
# TensorFlow's CPU kernels cannot group, so Keras compiles these with XLA,
# whose CPU convolution runs them at about 1 GFLOP/s: ``benchmarks/op_rates.py``
# measures 1.1 G alone against the 3x3 convolution's 222 G of work per second,
# and with this price ConvNeXtTiny's forward pass runs at the other zoo
# models' work per second (215 G; 31 G priced as a dense convolution's FLOPs,
# when its caps' plans recomputed all 18, measuring 1.24-1.30x plain's step
# time under max_recompute=0.05). On a GPU, cuDNN groups them at dense rates.
GROUPED_CONV_ON_CPU = 250.0
CONVOLUTIONS = frozenset({"Conv", "Conv2D", "Conv3D"})
SOFTMAXES = frozenset({"Softmax", "LogSoftmax", "SoftmaxCrossEntropyWithLogits",
                       "SparseSoftmaxCrossEntropyWithLogits"})


def cost_kind(op_type):
    """Which :data:`BYTE_COST` prices an op type's bytes."""
    if (op_type in optable.MATMULS or op_type == "Einsum" or op_type.startswith("Conv")
            or op_type == "DepthwiseConv2dNative"):
        return "dense"
    return "softmax" if op_type in SOFTMAXES else "other"


def op_cost(op, shape_of=lambda t: t.shape):
    """Work to recompute ``op`` in FLOP-equivalents: FLOPs (exact-ish for
    matmul/conv, one per output element otherwise; a grouped convolution's
    on a CPU at :data:`GROUPED_CONV_ON_CPU`) plus the bytes it reads and
    writes at its kind's :data:`BYTE_COST` (see :func:`cost_parts`)."""
    flops, moved = cost_parts(op, shape_of)
    return flops + sum(BYTE_COST[kind] * n for kind, n in moved.items())


# Ops that run no kernel worth counting: inputs, constants, variable reads.
_FREE = frozenset({"Placeholder", "Const", "NoOp", "VarHandleOp"}) | optable.INPUT_READS


def cost_parts(op, shape_of=lambda t: t.shape, device=""):
    """``(FLOPs, {cost kind: bytes moved})`` of ``op``, a grouped convolution's
    FLOPs on a CPU times :data:`GROUPED_CONV_ON_CPU`. An op whose outputs
    are its inputs' buffers (a reshape) moves nothing; a function call
    counts its body (Keras compiles grouped convolutions into calls), on
    the call's device (``device``: the enclosing call's)."""
    if op.type in _FREE or (op.outputs and all(
            optable.forwarded_input(op, k) is not None for k in range(len(op.outputs)))):
        return 0.0, {}
    device = op.device or device
    body = tf_internal.called_graph(op)
    if body is not None:
        flops, moved = 0.0, collections.Counter()
        for inner in body.get_operations():
            inner_flops, inner_moved = cost_parts(inner, device=device)
            flops += inner_flops
            moved.update(inner_moved)
        return flops, dict(moved)
    flops = _flops(op, shape_of)
    if _grouped(op, shape_of) and _on_cpu(device):
        flops *= GROUPED_CONV_ON_CPU
    return flops, {cost_kind(op.type): _bytes_moved(op, shape_of)}


def _grouped(op, shape_of):
    """Whether ``op`` is a convolution whose filter reads fewer channels than
    its input has (a grouped or depthwise one in TensorFlow's Conv ops)."""
    if op.type not in CONVOLUTIONS or len(op.inputs) < 2:
        return False
    x, w = shape_of(op.inputs[0]), shape_of(op.inputs[1])
    if x.rank is None or w.rank is None or x.rank != w.rank:
        return False
    try:
        layout = op.get_attr("data_format")
    except ValueError:
        layout = b"NHWC"
    layout = layout.decode() if isinstance(layout, bytes) else layout
    channels = x[1] if layout.startswith("NC") or layout == "CHANNELS_FIRST" else x[-1]
    return channels is not None and w[-2] is not None and w[-2] < channels


def _on_cpu(device):
    """Whether an op placed on ``device`` runs on a CPU: the device's type, or,
    where TensorFlow places the op (``device`` ""), whether no GPU is visible."""
    kind = tf.DeviceSpec.from_string(device).device_type if device else None
    if kind:
        return kind.upper() == "CPU"
    return not tf.config.list_physical_devices("GPU")


def _bytes_moved(op, shape_of):
    total = 0
    for t in list(op.inputs) + list(op.outputs):
        if t.dtype in (tf.resource, tf.variant, tf.string):
            continue
        n = num_elements(shape_of(t))
        total += (n or 0) * t.dtype.size
    return total


def _flops(op, shape_of):
    out = num_elements(shape_of(op.outputs[0])) if op.outputs else 0
    out = out or 1
    try:
        if op.type in optable.MATMULS:
            a = shape_of(op.inputs[0])
            adj = op.get_attr("transpose_a") if op.type == "MatMul" else op.get_attr("adj_x")
            k = a[-2] if adj else a[-1]
            return 2.0 * out * (k or 1)
        if op.type.startswith("Conv") or op.type == "DepthwiseConv2dNative":
            w = shape_of(op.inputs[1])
            if w.rank is not None:
                kernel = num_elements(w[:-1]) if op.type != "DepthwiseConv2dNative" else num_elements(w[:-2])
                return 2.0 * out * (kernel or 1)
        if op.type == "Einsum":
            return 2.0 * out * _einsum_contracted(op, shape_of)
    except (ValueError, TypeError, IndexError):
        pass
    return float(out)


def _einsum_contracted(op, shape_of):
    """The product of an einsum's contracted axes (in an input, not in the
    output): its FLOPs are 2 x output elements x that ('bqhd,bkhd->bhqk'
    multiplies over d). Unknown sizes count as 1."""
    equation = op.get_attr("equation")
    equation = equation.decode() if isinstance(equation, bytes) else equation
    inputs, _, output = equation.replace(" ", "").partition("->")
    sizes = {}
    for spec, t in zip(inputs.split(","), op.inputs):
        shape = shape_of(t)
        if shape.rank is None:
            continue
        dims = shape.as_list()
        if "..." in spec:   # the ellipsis' axes are batch axes, never contracted
            head, tail = spec.split("...")
            dims = dims[:len(head)] + (dims[len(dims) - len(tail):] if tail else [])
            spec = head + tail
        for letter, d in zip(spec, dims):
            if d is not None:
                sizes[letter] = max(sizes.get(letter, 1), d)
    contracted = 1
    for letter in set(inputs.replace(",", "").replace(".", "")) - set(output):
        contracted *= sizes.get(letter, 1)
    return contracted


def _custom_gradient_args(op, region):
    """The inputs a ``tf.custom_gradient`` op's gradient may read, or None.

    In a graph, ``tf.custom_gradient`` ends in an ``IdentityN`` over the
    results, then the function's arguments (and variables), whose gradient
    is a Python closure: it reads what it captured, typically the arguments
    (``tf.nn.silu`` keeps only its input). The results are the outputs the
    forward pass reads (a gradient built earlier reads the others too).
    """
    if op.type != "IdentityN":
        return None
    try:
        kind = op.get_attr("_gradient_op_type")
    except ValueError:
        return None
    if not kind.startswith(b"CustomGradient"):
        return None
    ys = {y.ref() for y in region.ys}
    used = [out.ref() in ys or any(c in region.ops for c in out.consumers())
            for out in op.outputs]
    results = len(used) - used[::-1].index(True) if any(used) else 0
    return op.inputs[results:]


def backprop_reads(region):
    """``{op: (inputs read, outputs read)}`` by the gradient plain backprop runs.

    An input that no gradient reaches (a constant, data) gets none, so what
    only its gradient would read is not kept (see :func:`grad_reads`).
    An op inside a ``tf.custom_gradient`` function is never differentiated:
    the closure replaces its gradient, so what it would read is not kept
    (only what the closure reads, see :func:`_custom_gradient_args`).
    Inside means behind a result, made after the function's arguments.
    """
    xs = {x.ref() for x in region.xs}

    def needs_gradient(t):
        # Backprop reaches only the region's tensors and the xs.
        return differentiable(t) and (t.op in region.ops or t.ref() in xs)

    ys = {y.ref() for y in region.ys}

    def gets_gradient(t):
        # An output gets a gradient if it is a y or a region op reads it.
        return t.ref() in ys or any(c in region.ops for c in t.consumers())

    reads = {op: grad_reads(op, needs_gradient, gets_gradient) for op in region.order}
    for op in region.order:
        args = _custom_gradient_args(op, region)
        if args is None:
            continue
        reads[op] = (args, ())
        first = max((tf_internal.op_id(a.op) for a in args), default=-1)
        stack = [t.op for t in op.inputs[:len(op.inputs) - len(args)]]
        seen = set()
        while stack:
            inner = stack.pop()
            if (inner in seen or inner not in reads or inner is op
                    or tf_internal.op_id(inner) <= first):
                continue
            seen.add(inner)
            reads[inner] = ((), ())
            stack.extend(t.op for t in inner.inputs)
    return reads


def fused_under_xla(region):
    """Names of tensors XLA keeps inside a fusion: outputs of fusible ops
    (:data:`memsave.graph.optable.FUSIBLE`) that only fusible ops of the
    region read. Plain XLA backprop does not hold them (its fused backward
    recomputes them from the fusion's inputs), and recomputing them costs
    nothing. They stay candidates: a kept one is materialized."""
    ys = {y.ref() for y in region.ys}
    out = set()
    for op in region.order:
        if op.type not in optable.FUSIBLE:
            continue
        for t in op.outputs:
            readers = [c for c in t.consumers() if c in region.ops]
            if (readers and t.ref() not in ys
                    and all(c.type in optable.FUSIBLE for c in readers)):
                out.add(t.name)
    return out


# Sums in these dtypes lose most of their digits unless accumulated wider.
_HALF_PRECISION = frozenset({tf.bfloat16, tf.float16})


def biased_in_half_precision(region):
    """``(names, sums)``: the half-precision outputs of matmuls and
    convolutions that only bias adds read (``BiasAdd``, or an add of a
    per-channel vector, as Keras adds its biases), and those bias adds'
    outputs.

    A plan must not keep such an output apart from its bias add: TF's
    remappers fuse the two, and with oneDNN the fused backward sums the
    bias gradient in float32. Split into two segments, the bias gradient
    runs alone, and TF's CPU kernel sums it in bfloat16: a Keras CNN under
    mixed_bfloat16 got bias gradients 40-80% off plain's. The bias add's
    output stands in for the matmul's (the same bytes; its recomputation
    adds one elementwise op).
    """
    names, sums = set(), set()
    for op in region.order:
        if op.type not in optable.EXPENSIVE:
            continue
        for t in op.outputs:
            if t.dtype.base_dtype not in _HALF_PRECISION:
                continue
            readers = [c for c in t.consumers() if c in region.ops]
            if readers and all(_adds_a_bias(c, t) for c in readers):
                names.add(t.name)
                sums.update(c.outputs[0].name for c in readers)
    return names, sums


def sums_bias_in_half_precision(op):
    """Whether ``op`` is a half-precision ``BiasAdd``: TF's CPU kernel for
    its gradient (BiasAddGrad, unfused) sums in that dtype, 0.75 of the
    largest entry off the exact sum over 4,096 bfloat16 rows (a
    ``reduce_sum`` or a matmul accumulates in float32: 2-7e-3). Summed
    once per segment instead of once in all, the rounding is another one."""
    return (op.type in ("BiasAdd", "BiasAddV1")
            and op.outputs[0].dtype.base_dtype in _HALF_PRECISION)


def _adds_a_bias(op, t):
    """Whether ``op`` adds a bias (one value per last-axis channel) to ``t``."""
    if op.type == "BiasAdd":
        return op.inputs[0].name == t.name
    if op.type not in ("AddV2", "Add"):
        return False
    others = [i for i in op.inputs if i.name != t.name]
    if len(others) != 1 or not others[0].shape.rank or t.shape.rank is None:
        return False   # t twice, or a bias of unknown rank or a scalar
    dims = others[0].shape.as_list()
    return (len(dims) <= t.shape.rank and all(d == 1 for d in dims[:-1])
            and dims[-1] is not None and dims[-1] == t.shape[-1])


def _fusion_inputs(names, region, fused):
    """The tensors outside XLA's fusions that the fused tensors ``names`` are
    computed from. A gradient that reads a fused value recomputes it inside
    its own fusion from these, so it reads them instead: GELU's backward
    reads the matmul output under the bias add, and a plan that keeps
    neither recomputes the matmul."""
    out, stack, seen = set(), list(names), set()
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        for t in region.graph.get_tensor_by_name(name).op.inputs:
            if t.name in fused:
                stack.append(t.name)
            elif t.op in region.ops and differentiable(t):
                out.add(t.name)
    return out


def to_plan_graph(region, batch_size=None, shapes=None, compiled=False):
    """Export the region as a :class:`~memsave.planning.dag.PlanGraph` over tensor names.

    Nodes are tensors (region op outputs, and the xs); edges go from each
    input of a region op to each of its outputs. Unknown dimensions count as
    ``batch_size``, or 1 without that hint (``sized_exactly`` is then False
    and ``unknown_dims`` counts them). ``shapes`` (``{tensor name:
    TensorShape}``, see :mod:`memsave.graph.shapes`) overrides static shapes
    that the graph leaves unknown. With ``compiled`` (XLA compiles the
    step), tensors XLA keeps inside a fusion (:func:`fused_under_xla`) are
    not kept by plain backprop and cost nothing to recompute (measured on
    the deviceless H100: GPT2's default plan took 46% of plain's temp
    buffers without this, 37% with it; ResNet50's 34% either way).
    """
    shapes = shapes or {}

    def shape_of(t):
        return shapes.get(t.name, t.shape)

    g = PlanGraph()
    g.compiled = compiled
    reads = backprop_reads(region)
    marks = _marks(region, reads, compiled)
    _add_leaf_xs(g, region.leaf_xs, shape_of, batch_size)
    g.unknown_dims = _add_region_tensors(g, region, reads, marks, shape_of, batch_size,
                                         compiled)
    return g


# Names of region tensors by what the planning graph flags on them: ``saved``
# (some gradient reads it), ``reads_output`` (its producer's gradient reads
# it), the ys, the forced, ``read_in_place`` (inputs of pinned ops) and
# ``fused`` (kept inside an XLA fusion, see fused_under_xla), and ``biased``
# and ``bias_sums`` (see biased_in_half_precision).
_Marks = collections.namedtuple(
    "_Marks", "saved reads_output ys forced read_in_place fused biased bias_sums")


def _marks(region, reads, compiled):
    """What :func:`to_plan_graph` flags, by tensor name, from ``reads``
    (:func:`backprop_reads`) and the region."""
    saved, reads_output = set(), set()
    for op in region.order:
        ins, outs = reads[op]
        saved.update(t.name for t in ins if differentiable(t))
        saved.update(t.name for t in outs if differentiable(t))
        reads_output.update(t.name for t in outs)
    y_names = {y.name for y in region.ys}
    forced = {t.name for t in region.forced}
    # A pinned op is differentiated in place, so its gradient reads the
    # original inputs: those cannot wait on the host.
    read_in_place = {t.name for op in region.pinned for t in op.inputs}
    fused = fused_under_xla(region) if compiled else set()
    saved = (saved - fused) | _fusion_inputs(saved & fused, region, fused)
    biased, bias_sums = biased_in_half_precision(region)
    return _Marks(saved, reads_output, y_names, forced, read_in_place, fused, biased, bias_sums)


def _add_leaf_xs(g, leaf_xs, shape_of, batch_size):
    """The xs, first (negative ``order``): their bytes are not counted, the
    gradient pieces their readers send them are."""
    for i, x in enumerate(leaf_xs):
        elements = num_elements(shape_of(x), batch_size or 1)
        g.add_tensor(x.name, order=-len(leaf_xs) + i, elements=num_elements(x.shape),
                     op_type=x.op.type, x=True,
                     grad_bytes=(elements * x.dtype.size
                                 if differentiable(x) and elements is not None else None))


def _add_region_tensors(g, region, reads, marks, shape_of, batch_size, compiled):
    """Add every region op's outputs in topological order, with edges from the
    op's region (or x) inputs; returns how many have a shape not fully known.

    Scratch of a backward op: an XLA-compiled call's buffers (where the
    step itself is not compiled: XLA then inlines the call and plans its
    buffers with the step's). State kept for a backward op: a loop's
    accumulators, on its first output a gradient comes back along."""
    x_names = {x.name for x in region.leaf_xs}
    index, unknown = 0, 0
    for op in region.order:
        cost = op_cost(op, shape_of)
        kind = optable.flags(op.type)
        scratch = state = 0
        if functions.is_loop(op):
            state = loop_accumulators(op, batch_size)
        elif not compiled:
            scratch = compiled_calls.gradient_scratch(
                op, shape_of, lambda t: bool(t.consumers()) or t.name in marks.ys)
        holder = state and next((t for t in op.outputs if carries_gradient(t) and (
            t.name in marks.ys or any(c in region.ops for c in t.consumers()))), None)
        for k, t in enumerate(op.outputs):
            shape = shape_of(t)
            forwarded = optable.forwarded_input(op, k)
            g.add_tensor(t.name, order=index, shares_buffer=(
                forwarded.name if forwarded is not None and g.has_node(forwarded.name)
                else None), scratch_bytes=scratch, state_bytes=state if t is holder else 0,
                **_output_fields(t, op, shape, cost, kind, reads, marks, region, batch_size))
            index += 1
            if not shape.is_fully_defined() and not optable.kernel_sized(op, k):
                unknown += 1
            for i in op.inputs:
                if i.op in region.ops or i.name in x_names:
                    g.add_edge(i.name, t.name)
    return unknown


def loop_accumulators(op, batch_size=None):
    """Bytes a while loop ``op``'s gradient accumulates: every iteration pushes
    the body tensors the body's gradient reads onto TensorLists (outputs the
    gradient adds to the loop), which live until the loop's gradient has run.
    They are not among the loop's outputs when the region is planned, so they
    count as state its backward keeps (see TensorNode.state_bytes): a Keras
    LSTM (batch 32, 100 steps, 128 units) was estimated at 0.1 MiB without
    them and 11.7 with them; the meter reads 12.5 or 20.7 between runs. 0
    where the trip count is not known statically.

    Each differentiated copy of a loop makes its own, from its segment's
    recomputation to the loop's backward; plain backprop holds every loop's
    from the forward pass. Counted as scratch of the loop's backward alone,
    stacked loops' did not overlap, and plain's estimate ran low (three
    Keras LSTMs of 256 units over 128 steps: 24 MiB estimated, 100-133
    measured), and so did plans that recompute several loops in one segment.

    Counted: per iteration, the body tensors some body op's gradient reads
    (:func:`grad_reads`) that change from one iteration to the next. TF
    pushes the body's variable reads too, but they alias the variable (no
    copy), and loop invariants are not pushed; nested loops' own
    accumulators are not counted. Unknown dimensions count as
    ``batch_size`` (1 without it)."""
    trips = _trip_count(op)
    if not trips:
        return 0
    try:
        body = functions.loop_body(op)
    except (LookupError, ValueError) as e:   # a body the function library lacks
        logger.debug("memsave: %s: no body to count its accumulators in (%s)", op.name, e)
        return 0
    changing = _changing(body)
    # What the body computes from its inputs: the loop's variables and the
    # tensors it captures (the weights, read inside the body).
    reached = {t.ref() for inner in forward_ops([t.op for t in body.inputs])
               for t in inner.outputs}

    def needs_gradient(t):
        return differentiable(t) and t.ref() in reached

    read = {}
    for inner in body.get_operations():
        if inner.type.startswith("TensorList"):
            continue   # their gradients read the lists and indices, not the elements
        ins, outs = grad_reads(inner, needs_gradient)
        for t in list(ins) + list(outs):
            if t.ref() in changing and differentiable(t):
                read[t.ref()] = t
    per_step = 0
    for t in read.values():
        n = num_elements(t.shape, batch_size or 1)
        per_step += (n or 0) * t.dtype.size
    return trips * per_step


def _changing(body):
    """Refs of the tensors of a loop ``body`` that depend on a loop variable
    the body changes (one not passed through to its own output slot)."""
    passed = {out.op.inputs[0].ref() if out.op.type == "Identity" else out.ref()
              for out in body.outputs}
    varying = [t for t in body.inputs if t.ref() not in passed]
    ops = forward_ops([t.op for t in varying])
    return {t.ref() for op in ops for t in op.outputs}


def _trip_count(op):
    """How many times a while_v2 loop ``op`` runs at most, where static: its
    maximum iterations (input 1) or the length of the sequences it unstacks
    (TensorLists made from a tensor, read one element per step), the smaller
    where both are known; None if neither is."""
    limit = tf.get_static_value(op.inputs[1])
    if limit is None and op.inputs[1].op.type in ("Max", "Min", "Identity"):
        # Keras' RNN loop: the max over no axes of the number of steps.
        source = op.inputs[1].op
        axes = tf.get_static_value(source.inputs[1]) if len(source.inputs) > 1 else []
        if axes is not None and len(axes) == 0:
            limit = tf.get_static_value(source.inputs[0])
    known = [int(limit)] if limit is not None and int(limit) >= 0 else []
    lengths = [t.op.inputs[0].shape[0] for t in op.inputs[2:]
               if t.op.type == "TensorListFromTensor" and t.op.inputs[0].shape.rank]
    lengths = [n for n in lengths if n is not None]
    if lengths:
        known.append(max(lengths))
    return min(known) if known else None


def _output_fields(t, op, shape, cost, kind, reads, marks, region, batch_size):
    """The :class:`~memsave.planning.dag.TensorNode` fields of ``t``, an
    output of ``op`` (``kind``: its :func:`optable.flags`)."""
    # A variable read aliases the variable's buffer: no activation memory.
    alias = kind["input_read"]
    if t.name in marks.bias_sums:   # stands in for its matmul's output
        kind = dict(kind, expensive=True)
    n = num_elements(shape, batch_size or 1)
    size = None if n is None else n * max(t.dtype.size, 1)
    return dict(elements=n,
                sized_exactly=shape.is_fully_defined() or bool(batch_size),
                bytes=0 if alias else size,
                grad_bytes=size if alias and differentiable(t) else None,
                cost=0.0 if t.name in marks.fused else float(cost), op_type=op.type,
                y=t.name in marks.ys,
                forced=t.name in marks.forced, saved=t.name in marks.saved,
                grad_reads_output=t.name in marks.reads_output,
                grad_reads_inputs=bool(reads[op][0]),
                candidate=(differentiable(t) and t.name not in marks.ys
                           and t.name not in marks.forced and op not in region.pinned
                           and not alias and t.name not in marks.biased),
                offloadable=(differentiable(t) and t.name not in marks.ys and not alias
                             and t.name not in marks.read_in_place),
                **kind)
