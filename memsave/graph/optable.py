"""What memsave knows about TensorFlow op types, in one table.

The planners never see op names: :func:`flags` turns an op into the neutral
fields of :class:`memsave.planning.dag.TensorNode`. Unknown ops get the
safe answers (their gradient reads inputs and outputs; not expensive).
"""

# What each op's gradient reads besides the incoming gradient: its inputs,
# its outputs, or neither. This is what backprop keeps alive, so it drives
# the memory estimates.
GRAD_READS_NOTHING = frozenset({
    "Add", "AddV2", "AddN", "Sub", "BiasAdd", "Identity", "IdentityN", "Neg", "Reshape",
    "ConcatV2", "Concat", "Split", "SplitV", "Transpose", "StopGradient", "Sum", "Mean",
    "Pad", "Slice", "StridedSlice", "Cast", "ExpandDims", "Squeeze", "Tile", "Pack",
    "Unpack", "ZerosLike", "OnesLike", "Shape", "Size", "Rank", "Fill", "BroadcastTo",
    "GatherV2", "ResourceGather", "ReadVariableOp", "Const", "SelectV2", "Select",
})
GRAD_READS_OUTPUTS = frozenset({
    "Tanh", "Sigmoid", "Relu", "Relu6", "Elu", "Selu", "Exp", "Sqrt", "Rsqrt",
    "Softmax", "Reciprocal", "Inv",
})
GRAD_READS_INPUTS = frozenset({
    "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum", "Conv2D",
    "Conv3D", "DepthwiseConv2dNative", "Conv", "Mul", "Div", "RealDiv", "DivNoNan",
    "Maximum", "Minimum", "SquaredDifference", "Square", "Log", "Log1p", "Sin", "Cos",
    "Abs", "LeakyRelu", "Softplus", "Erf", "FusedBatchNorm", "FusedBatchNormV2",
    "FusedBatchNormV3", "MaxPool", "AvgPool", "Conv2DBackpropInput",
})

# Outputs whose size the kernel chooses, left unknown by the graph: a fused
# batch norm's reserve space (empty on CPU, a small cache for cuDNN). No
# shape hint can size them, so they are not counted among the tensors of
# unknown size (which would warn and keep a plan from falling back to
# plain gradients); they are sized as one element.
KERNEL_SIZED_OUTPUTS = {"FusedBatchNormV3": frozenset({5})}


def kernel_sized(op, index):
    """Whether output ``index`` of ``op`` is sized by its kernel (see
    :data:`KERNEL_SIZED_OUTPUTS`)."""
    return index in KERNEL_SIZED_OUTPUTS.get(op.type, ())


# Ops whose gradient for their params is IndexedSlices: one row per lookup.
SPARSE_GRADIENT = frozenset({"GatherV2", "Gather"})
# Ops whose gradient for their data is IndexedSlices (a row per distinct id)
# where their ``sparse_gradient`` attribute asks for it (tf.sparse.segment_*).
SPARSE_GRADIENT_IF_ASKED = frozenset({
    "SparseSegmentSum", "SparseSegmentMean", "SparseSegmentSqrtN",
    "SparseSegmentSumWithNumSegments", "SparseSegmentMeanWithNumSegments",
    "SparseSegmentSqrtNWithNumSegments",
})

MATMULS = frozenset({"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"})

# Many FLOPs per output byte: worth keeping (or offloading) rather than
# recomputing. Their gradients read only their inputs.
EXPENSIVE = MATMULS | frozenset({
    "Einsum", "Conv", "Conv2D", "Conv3D", "Conv2DBackpropInput", "Conv3DBackpropInputV2",
    "DepthwiseConv2dNative", "_FusedMatMul", "_FusedConv2D",
})

# Gradient = a weight gradient that reads the input activation + an input
# gradient that does not (see memsave.planning.rules).
SPLIT_GRADIENT = MATMULS | frozenset({
    "Einsum", "Conv", "Conv2D", "Conv3D", "DepthwiseConv2dNative",
})

# Elementwise ops (and reshapes, which XLA makes bitcasts): XLA fuses chains
# of them into one kernel, so what one of them passes to another never
# exists in memory, and recomputing it costs nothing beyond the fused
# kernel's own reads.
FUSIBLE = frozenset({
    "Add", "AddV2", "Sub", "Mul", "Div", "RealDiv", "DivNoNan", "Neg", "Abs", "Sign",
    "Square", "SquaredDifference", "Sqrt", "Rsqrt", "Reciprocal", "Inv", "Pow", "Exp",
    "Expm1", "Log", "Log1p", "Tanh", "Sigmoid", "Relu", "Relu6", "Elu", "Selu", "LeakyRelu",
    "Softplus", "Softsign", "Erf", "Erfc", "Sin", "Cos", "Maximum", "Minimum", "Floor",
    "Ceil", "Round", "Cast", "Select", "SelectV2", "BiasAdd", "Identity", "ZerosLike",
    "OnesLike", "Reshape", "ExpandDims", "Squeeze", "StopGradient", "ClipByValue",
    "Greater", "GreaterEqual", "Less", "LessEqual", "Equal", "NotEqual", "LogicalAnd",
    "LogicalOr", "LogicalNot",
})

# Outputs that alias an x's buffer (a variable's current value): no memory.
INPUT_READS = frozenset({"ReadVariableOp"})

# Ops whose output is an input's buffer (TensorFlow forwards it, a reshape
# with a new shape): keeping both costs one buffer. {op type: the input each
# output forwards, None for output i forwarding input i}.
FORWARDS_INPUT = {"Identity": 0, "IdentityN": None, "Reshape": 0, "Squeeze": 0,
                  "ExpandDims": 0, "StopGradient": 0, "PreventGradient": 0, "EnsureShape": 0}


def forwarded_input(op, output_index):
    """The input of ``op`` whose buffer its output ``output_index`` is, or None
    (an identity across devices copies)."""
    if op.type not in FORWARDS_INPUT:
        return None
    i = FORWARDS_INPUT[op.type]
    i = output_index if i is None else i
    if i >= len(op.inputs):
        return None
    source = op.inputs[i]
    same = source.dtype == op.outputs[output_index].dtype and source.op.device == op.device
    return source if same else None


# Ops whose output may be an input's buffer, always (FORWARDS_INPUT) or where
# they change nothing, which TensorFlow's kernels check at run time: a full
# or outer-axis slice, an identity permutation, a tile by ones, a broadcast
# or a cast to the same shape or type, zero padding, a single addend or
# concatenated tensor, a reduction over no axes, a check of the values.
# What an op reading a TF1 reference variable's buffer may see change (see
# memsave.graph.stateful.ref_variables); not a guarantee for memory.
MAY_SHARE_INPUT = frozenset(FORWARDS_INPUT) | frozenset({
    "Snapshot", "CheckNumerics", "CheckNumericsV2", "DebugIdentity", "DebugIdentityV2",
    "DebugIdentityV3", "Bitcast", "Cast", "BroadcastTo", "Tile", "Transpose",
    "ConjugateTranspose", "Slice", "StridedSlice", "Split", "SplitV", "Unpack", "Pad",
    "PadV2", "MirrorPad", "ConcatV2", "Concat", "AddN", "Sum", "Mean", "Max", "Min", "Prod",
    "All", "Any", "EuclideanNorm", "ReverseV2", "Roll", "Enter", "RefEnter", "Exit",
    "RefExit", "Switch", "RefSwitch", "Merge", "RefMerge", "NextIteration",
    "RefNextIteration", "Print", "PrintV2", "PlaceholderWithDefault", "GuaranteeConst",
    "MatrixBandPart", "Einsum", "SpaceToBatchND", "BatchToSpaceND", "Pack",
    # A call or a loop may return an input unchanged.
    "If", "StatelessIf", "While", "StatelessWhile", "Case", "StatelessCase",
    "PartitionedCall", "StatefulPartitionedCall",
    # Grappler makes these an Identity where a constant input makes them one
    # (pow(x, 1), a select on a constant condition).
    "Pow", "Select", "SelectV2",
})

# Ops that only read their input's metadata: they never keep it alive.
METADATA = frozenset({"Shape", "ShapeN", "Size", "Rank"})


# Ops whose gradient with respect to one input reads only the other inputs
# (d(a*b)/da = g*b; a convolution's input gradient reads the filter).
GRAD_READS_OTHER_INPUTS = MATMULS | frozenset({
    "Mul", "Einsum", "Conv2D", "Conv3D", "DepthwiseConv2dNative",
})


# Cross-entropies on logits: output 1 is the loss's gradient w.r.t. the
# logits (softmax minus labels), which their gradient scales; the logits are
# read only for a gradient that reaches output 1 (a second derivative) or,
# with dense labels, for the labels' gradient (TensorFlow's nn_grad).
CROSS_ENTROPIES = frozenset({"SparseSoftmaxCrossEntropyWithLogits",
                             "SoftmaxCrossEntropyWithLogits"})


def _reads_per_input(op, gets_gradient):
    """{input index: (input indices, output indices) its gradient reads}, or None."""
    n = len(op.inputs)
    if op.type in CROSS_ENTROPIES and n == 2 and len(op.outputs) == 2:
        logits = [0] if gets_gradient(op.outputs[1]) else []
        labels = [0] if op.type == "SoftmaxCrossEntropyWithLogits" else []
        return {0: (logits, [1]), 1: (labels, [])}
    if op.type in GRAD_READS_OTHER_INPUTS:
        return {i: ([j for j in range(n) if j != i], []) for i in range(n)}
    if op.type in ("Div", "RealDiv", "DivNoNan") and n == 2:
        return {0: ([1], []), 1: ([0, 1], [])}     # g / y; -g * x / y**2
    if op.type == "Pow" and n == 2:
        return {0: ([0, 1], []), 1: ([0], [0])}    # g * y * x**(y-1); g * z * log(x)
    return None


def grad_reads(op, needs_gradient=None, gets_gradient=None):
    """(inputs read, outputs read) by ``op``'s gradient.

    With ``needs_gradient(tensor)``, only what the gradients of the inputs
    that need one read: the gradient of a constant factor or of data (no x
    behind it) is never used, so the step prunes it, and what only it reads
    is not kept (``0.5 * x`` keeps nothing; ``x ** 3`` does not keep its
    output). ``gets_gradient(output)``: whether backprop sends ``op`` a
    gradient for that output (default: whether anything reads it).
    """
    gets_gradient = gets_gradient or (lambda t: bool(t.consumers()))
    per_input = _reads_per_input(op, gets_gradient) if needs_gradient is not None else None
    if per_input is not None:
        ins, outs = set(), set()
        for i, t in enumerate(op.inputs):
            if needs_gradient(t):
                ins.update(per_input[i][0])
                outs.update(per_input[i][1])
        return ([op.inputs[i] for i in sorted(ins)], [op.outputs[k] for k in sorted(outs)])
    if op.type in GRAD_READS_NOTHING:
        return (), ()
    if op.type in GRAD_READS_OUTPUTS:
        return (), op.outputs
    if op.type in GRAD_READS_INPUTS:
        return op.inputs, ()
    return op.inputs, op.outputs


def flags(op_type):
    """The op-kind fields of a planning-graph node for an output of ``op_type``."""
    return dict(expensive=op_type in EXPENSIVE, split_gradient=op_type in SPLIT_GRADIENT,
                input_read=op_type in INPUT_READS)
