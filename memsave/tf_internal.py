"""Every private TensorFlow API memsave uses, behind one door.

This is the only module of memsave that imports ``tensorflow.python``,
``tensorflow.core`` or ``tensorflow.compiler``, or touches a private
attribute of a TensorFlow object; everything else uses the public ``tf.*``
API, or the names below. Each name says, in the comment above it, why no
public API does the job.

At import every symbol in :data:`SYMBOLS` is looked up: if one is missing,
importing memsave fails with an :class:`ImportError` naming the symbol, the
installed TensorFlow version and the tested one, instead of failing later
in the middle of a rewrite. A TensorFlow whose major.minor version is not
:data:`TESTED_TF` but has every symbol only gets a WARNING (logger
``"memsave"``). ``tests/test_tf_internal.py`` checks each symbol on the
pinned TensorFlow.
"""

import collections
import contextlib
import functools
import importlib
import logging
import threading

import tensorflow as tf

logger = logging.getLogger("memsave")

# The TensorFlow release (major.minor) memsave is tested with.
TESTED_TF = "2.21"


def _installed_version():
    return getattr(tf, "__version__", "unknown")


def _missing_message(what, error):
    return ("memsave needs the TensorFlow internal %s, which the installed TensorFlow %s "
            "does not have (memsave is tested with TensorFlow %s.x; install that version): "
            "%s: %s" % (what, _installed_version(), TESTED_TF, type(error).__name__, error))


try:
    import tensorflow.python.pywrap_tfe
    import tensorflow.python.client.session
    import tensorflow.python.data.ops.dataset_ops
    import tensorflow.python.eager.backprop_util
    import tensorflow.python.eager.record
    import tensorflow.python.eager.tape
    import tensorflow.python.framework.composite_tensor_gradient
    import tensorflow.python.framework.func_graph
    import tensorflow.python.framework.op_def_registry
    import tensorflow.python.framework.ops
    import tensorflow.compiler.tf2xla.ops.gen_xla_ops
    import tensorflow.python.ops.control_flow_util
    import tensorflow.python.ops.control_flow_util_v2
    import tensorflow.python.ops.default_gradient
    import tensorflow.python.ops.gradients
    import tensorflow.python.ops.gradients_impl
    import tensorflow.python.ops.gradients_util
    import tensorflow.python.ops.handle_data_util
    import tensorflow.python.ops.ref_variable
    import tensorflow.python.util.variable_utils
    import tensorflow.python.ops.resource_variable_ops
    import tensorflow.compiler.xla.service.hlo_pb2
except ImportError as _e:
    raise ImportError(_missing_message("module %s" % (_e.name or ""), _e)) from _e


# (what, getter): every private symbol and attribute memsave relies on. A
# getter returns the object or raises (AttributeError, ImportError, ...).
_symbols = []


def _resolve(what, getter):
    """What ``getter`` gives, or an ImportError naming ``what`` and the versions."""
    try:
        return getter()
    except Exception as e:  # pylint: disable=broad-except
        raise ImportError(_missing_message(what, e)) from e


def _need(what, getter):
    """Register ``(what, getter)`` in SYMBOLS and return what the getter gives."""
    _symbols.append((what, getter))
    return _resolve(what, getter)


def _has(owner, name):
    """A getter checking that ``owner`` (a class, or a function giving a probe object)
    has the attribute ``name``; it returns True or raises AttributeError."""
    def get():
        target = owner if isinstance(owner, type) else owner()
        getattr(target, name)
        return True
    return get


_probes = {}


def _probe(kind):
    """Scratch objects for attributes TF sets on instances only (built once, cheap)."""
    if not _probes:
        graph = tf.Graph()
        with graph.as_default():
            op = tf.no_op(name="memsave_probe")
        _probes["graph"], _probes["op"] = graph, op
        _probes["tape"] = tf.GradientTape()
    return _probes[kind]


def _lookup(path):
    """The module attribute ``path`` names (a dotted path; its module is imported above)."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _need_symbols(table):
    """:func:`_need` the ``path`` of each row ``(export, path)`` of ``table`` in
    order; the exports (rows whose ``export`` is not None) are returned by name."""
    found = {}
    for export, path in table:
        value = _need(path, functools.partial(_lookup, path))
        if export is not None:
            found[export] = value
    return found


def _need_attributes(table):
    """:func:`_need` each private attribute of rows ``(label, owner, names)``: the
    owner is a class, or a function giving a probe object; the label names it."""
    for label, owner, names in table:
        for name in names:
            _need("%s.%s" % (label, name), _has(owner, name))


# ---------------------------------------------------------------------------
# Classes and functions: (the name memsave uses, what it is), each with the
# reason no public API does the job. Rows named None are not used through
# this module but must exist: memsave.patch() patches them.

_SYMBOLS_TABLE = (
    # The class of eager tensors: tf.__internal__.EagerTensor is private too, and
    # tf.is_symbolic_tensor differs (it is also true for Keras symbolic tensors).
    ("EagerTensor", "tensorflow.python.framework.ops.EagerTensor"),
    # The graph class of tf.function / control-flow bodies (captures, outer_graph);
    # only tf.__internal__.FuncGraph, which is private too.
    ("FuncGraph", "tensorflow.python.framework.func_graph.FuncGraph"),
    # The common base of tf.compat.v1.Session and InteractiveSession; not exported.
    ("BaseSession", "tensorflow.python.client.session.BaseSession"),
    # Resource handle dtype/shape metadata (what a variable handle reads as) has
    # no public API; copies of ops must carry it or variable reads lose shapes.
    ("copy_handle_data", "tensorflow.python.ops.handle_data_util.copy_handle_data"),
    # The dtype and shape a graph resource handle's variable holds (a source
    # given as ``v.handle``); only tf.__internal__, which is private too.
    ("resource_handle_data", "tensorflow.python.ops.handle_data_util.get_resource_handle_data"),
    # True for resource variables (and Keras/distributed wrappers of them); only
    # tf.__internal__.ops.is_resource_variable, which is private too.
    ("is_resource_variable", "tensorflow.python.ops.resource_variable_ops.is_resource_variable"),
    # Rebuilding a control-flow body (FuncGraph) from a While/If/Case function
    # attribute, as TF's own gradient does; no public API.
    ("get_func_graph", "tensorflow.python.ops.control_flow_util_v2.get_func_graph"),
    # Registering a FuncGraph as a function of its outer graph (the way while_v2
    # and cond_v2 do); no public API.
    ("create_new_tf_function", "tensorflow.python.ops.control_flow_util_v2.create_new_tf_function"),
    # A function name unique in the default graph's library; no public API.
    ("unique_fn_name", "tensorflow.python.ops.control_flow_util_v2.unique_fn_name"),
    # The OpDef of a registered op type (is it stateful?); no public registry lookup.
    ("get_op_def", "tensorflow.python.framework.op_def_registry.get"),
    # The gradient function registered for an op (None when it has none); no
    # public lookup (tf.RegisterGradient only registers).
    ("get_gradient_function", "tensorflow.python.framework.ops.get_gradient_function"),
    # tf.gradients' implementation below every public entry point; memsave
    # patches the public ones, so it must call this one to never recurse.
    ("gradients_helper", "tensorflow.python.ops.gradients_util._GradientsHelper"),
    # tf.gradients' forward walk from the xs, what it calls per tensor, and its
    # module (see fast_reachability).
    ("mark_reached_ops", "tensorflow.python.ops.gradients_util._MarkReachedOps"),
    # What it calls per differentiated op to log its gradients (see
    # _log_op_gradients).
    ("log_op_gradients", "tensorflow.python.ops.gradients_util._LogOpGradients"),
    ("consumers_across_captures", "tensorflow.python.ops.gradients_util._Consumers"),
    ("is_trainable", "tensorflow.python.eager.backprop_util.IsTrainable"),
    ("gradients_util_module", "tensorflow.python.ops.gradients_util"),
    # The zeros tf.gradients gives an unconnected x with UnconnectedGradients.ZERO
    # (a resource handle gets its variable's shape and dtype); no public API.
    ("zeros_for_unconnected", "tensorflow.python.ops.gradients_util._ZerosLike"),
    # The zeros tf.GradientTape gives an unconnected source with ZERO (resource
    # handles respected); no public API.
    ("default_zeros_like", "tensorflow.python.ops.default_gradient.zeros_like"),
    # Pause every active tape (tf.GradientTape.stop_recording pauses one tape).
    ("stop_recording", "tensorflow.python.eager.record.stop_recording"),
    # Would the active tapes record an op reading these tensors? No public API.
    ("should_record_backprop", "tensorflow.python.eager.record.should_record_backprop"),
    # Is any tape active at all? No public API.
    ("could_possibly_record", "tensorflow.python.eager.record.could_possibly_record"),
    # Pushing/popping a C++ tape on the thread's tape stack (to ask it what it
    # tracked); no public API.
    ("push_tape", "tensorflow.python.eager.tape.push_tape"),
    ("pop_tape", "tensorflow.python.eager.tape.pop_tape"),
    # How many tapes (and forward accumulators) track these tensors: 0, 1, or 2
    # for two or more (a persistent tape counts as 2). Only in the C API.
    ("possible_gradient_types", "tensorflow.python.pywrap_tfe.TFE_Py_TapeSetPossibleGradientTypes"),
    # Is the tape stack paused (inside a stop_recording block)? Only in the C API.
    ("tape_set_is_stopped", "tensorflow.python.pywrap_tfe.TFE_Py_TapeSetIsStopped"),
    # What GradientTape.gradient does with composite output_gradients; no public API.
    ("get_flat_tensors_for_gradients",
     "tensorflow.python.framework.composite_tensor_gradient.get_flat_tensors_for_gradients"),
    # What GradientTape.gradient does with variables in output_gradients; no public API.
    ("convert_variables_to_tensors",
     "tensorflow.python.util.variable_utils.convert_variables_to_tensors"),
    # Is the graph being traced for XLA (tf.function(jit_compile=True), Keras
    # jit_compile=True), it or a graph enclosing it? tf.function marks the trace
    # with an XLA control-flow context; no public API reads it.
    ("graph_compiled_by_xla", "tensorflow.python.ops.control_flow_util.GraphOrParentsInXlaContext"),
    # The TF1 while loop (a WhileContext) enclosing a control-flow context, or
    # None; TF1 control-flow contexts have no public API.
    ("containing_while_context",
     "tensorflow.python.ops.control_flow_util.GetContainingWhileContext"),
    # XLA's optimization barrier (jax.lax.optimization_barrier; what
    # jax.checkpoint(prevent_cse=True) uses): XLA neither merges nor moves
    # computation across it. Only the compiler's generated wrapper builds it
    # (tf.raw_ops lacks it); memsave inserts it only where XLA compiles the step.
    ("xla_optimization_barrier",
     "tensorflow.compiler.tf2xla.ops.gen_xla_ops.xla_optimization_barrier"),
    # The eager context: clearing its kernel cache is the only way to free a
    # per-step resource an aborted function call left in the shared step
    # container (tf.config has no such call).
    ("eager_context", "tensorflow.python.eager.context.context"),
    # The profiler's trace (what tf.profiler.experimental.stop writes): its
    # allocator events are the only per-allocation record of a step; TF exports
    # no reader for the file.
    ("XSpace", "tensorflow.tsl.profiler.protobuf.xplane_pb2.XSpace"),
    # XLA's compiled module with its buffer assignment (what
    # experimental_get_compiler_ir(stage="optimized_hlo_proto_serialized")
    # returns, serialized): the only record of the buffers a compiled
    # function allocates inside its call; TF exports no reader for it.
    ("HloProto", "tensorflow.compiler.xla.service.hlo_pb2.HloProto"),
    # A tf.data pipeline's steps: one input each, and those that keep its
    # elements' structure (prefetch, shuffle, repeat, cache, take, filter).
    # tf.data has no public way to read the batch size a pipeline was batched
    # with where the element spec leaves it unknown (see declared_batch_size).
    ("UnaryDataset", "tensorflow.python.data.ops.dataset_ops.UnaryDataset"),
    ("UnaryUnchangedStructureDataset",
     "tensorflow.python.data.ops.dataset_ops.UnaryUnchangedStructureDataset"),
    # The modules memsave.patch() patches besides tf and tf.compat.v1:
    # tf.compat.v1.train.Optimizer calls ``gradients.gradients`` from here.
    ("gradients_impl_module", "tensorflow.python.ops.gradients_impl"),
    ("gradients_module", "tensorflow.python.ops.gradients"),
    (None, "tensorflow.python.ops.gradients_impl.gradients"),
    (None, "tensorflow.python.ops.gradients_impl.gradients_v2"),
    (None, "tensorflow.python.ops.gradients.gradients"),
)
globals().update(_need_symbols(_SYMBOLS_TABLE))

# Patchable modules by a short name (for memsave.patching's patch points).
PATCHABLE_MODULES = {"gradients_impl": gradients_impl_module, "gradients": gradients_module}


# ---------------------------------------------------------------------------
# Private attributes, each behind a small named helper below.

_need_attributes((
    ("tf.Operation", tf.Operation, ("_id", "_add_control_inputs", "_add_control_input",
                                    "_control_outputs", "_set_device", "_input_types",
                                    "_update_input")),
    ("tf.Operation()", lambda: _probe("op"), ("_gradient_function",)),
    ("tf.Graph", tf.Graph, ("_create_op_internal", "_mutation_lock", "_get_function",
                            "_is_function", "_add_function_recursive",
                            "_get_control_flow_context")),
    ("tf.Graph()", lambda: _probe("graph"), ("_functions", "_add_control_dependencies")),
    ("RefVariable", _lookup("tensorflow.python.ops.ref_variable.RefVariable"), ("_ref",)),
    ("tf.GradientTape()", lambda: _probe("tape"),
     ("_tape", "_recording", "_persistent", "_watched_variables")),
    ("tf.GradientTape", tf.GradientTape, ("_pop_tape",)),
    ("tf.function()", lambda: tf.function(lambda: None),
     ("python_function", "_jit_compile", "_reduce_retracing", "_autograph")),
))


def function_options(function):
    """The ``tf.function(...)`` options ``function`` was made with (no public
    getter), so that memsave can trace its Python function again alike."""
    return dict(jit_compile=function._jit_compile,  # pylint: disable=protected-access
                reduce_retracing=function._reduce_retracing,  # pylint: disable=protected-access
                autograph=function._autograph)  # pylint: disable=protected-access


def xla_temp_bytes(serialized):
    """The bytes XLA's buffer assignment gives a compiled function's temporaries
    (not its parameters, outputs, constants or thread-local scalars), from a
    serialized HloProto (see :data:`HloProto`)."""
    proto = HloProto()
    proto.ParseFromString(serialized)
    return sum(a.size for a in proto.buffer_assignment.buffer_allocations
               if not (a.is_entry_computation_parameter or a.maybe_live_out or a.is_constant
                       or a.is_thread_local))


def clear_kernel_cache():
    """Drop the eager context's cached kernels and function instantiations: each
    function kernel's step container ('__per_step_0', shared on the device) is
    cleaned when it is destroyed, and with it a TemporaryVariable that a
    refused call made and never destroyed (TF 2.21). Stateful kernels restart
    (an op-seeded stateful random op repeats its sequence) and every function
    is instantiated (optimized by Grappler) again on its next call."""
    eager_context().clear_kernel_cache()


def declared_batch_size(dataset):
    """The batch size ``dataset`` was batched with (``batch``, ``padded_batch``),
    where only steps that keep its elements' structure follow (prefetch,
    shuffle, repeat, cache, take, filter); else None. Less where the batched
    dataset has fewer elements than that. Read without iterating the
    dataset (which would reshuffle it, or consume a stream)."""
    found = dataset
    while isinstance(found, UnaryUnchangedStructureDataset):
        found = getattr(found, "_input_dataset", None)
    if not isinstance(found, UnaryDataset):
        return None
    size = tf.get_static_value(getattr(found, "_batch_size", None))
    if size is None or size < 1:
        return None
    inner = getattr(found, "_input_dataset", None)
    count = int(inner.cardinality()) if isinstance(inner, tf.data.Dataset) else -1
    return int(min(size, count)) if count > 0 else int(size)


def in_graph(values, graph, like=()):
    """``values`` (gradients: tensors, IndexedSlices or None) as values of
    ``graph``. A custom gradient may return a value from outside it: an eager
    tensor it closed over (a constant made outside the tf.function, an
    IndexedSlices' indices) or a tensor of an enclosing function's graph,
    captured here as tf.function captures any outside value its ops read;
    or a numpy array or Python number, made a constant
    (of the dtype of the matching tensor of ``like``, where it has one, as a
    Python float for a float64 input). tf.gradients hands such a value on as
    it is; it has no op to walk from, nor can it be a later call's grad_ys."""
    hints = [None if t.dtype == tf.resource else t.dtype for t in like]

    def one(t, hint=None):
        if (isinstance(graph, FuncGraph) and isinstance(t, tf.Tensor)
                and (isinstance(t, EagerTensor) or t.graph is not graph)):
            return graph.capture(t)
        if t is None or isinstance(t, (tf.Tensor, tf.IndexedSlices)):
            return t
        with graph.as_default():
            return tf.convert_to_tensor(t, dtype_hint=hint)
    out = []
    for i, v in enumerate(values):
        if isinstance(v, tf.IndexedSlices):
            parts = (v.values, v.indices, v.dense_shape)
            made = tuple(one(c) for c in parts)
            if any(a is not b for a, b in zip(made, parts)):
                v = tf.IndexedSlices(*made)
        else:
            v = one(v, hints[i] if i < len(hints) else None)
        out.append(v)
    return out


def op_id(op):
    """The creation index of ``op`` in its graph (orders ops deterministically)."""
    return op._id  # pylint: disable=protected-access


# Grappler keeps nodes carrying this attribute (GrapplerItem::NodesToPreserve):
# it neither removes nor bypasses them, so no fusion can see through them.
PRESERVE = {"_grappler_do_not_remove": tf.compat.v1.AttrValue(b=True)}


def preserve(op):
    """Mark the existing ``op`` as one Grappler keeps (:data:`PRESERVE`)."""
    for key, value in PRESERVE.items():
        op._set_attr(key, value)  # pylint: disable=protected-access


def add_control_inputs(op, deps):
    """Make the existing ``op`` wait for the ops ``deps`` (no public way to edit an op)."""
    op._add_control_inputs(list(deps))  # pylint: disable=protected-access


def add_control_input(op, dep):
    """Make the existing ``op`` wait for the op ``dep``."""
    op._add_control_input(dep)  # pylint: disable=protected-access


def control_outputs(op):
    """The ops that have ``op`` as a control input (no public accessor)."""
    return op._control_outputs  # pylint: disable=protected-access


def set_device(op, device):
    """Set the device of an existing op (tf.device only applies to new ops)."""
    op._set_device(device)  # pylint: disable=protected-access


def input_types(op):
    """The dtypes ``op`` declares for its inputs (ref types included)."""
    return op._input_types  # pylint: disable=protected-access


def update_input(op, index, tensor):
    """Make the new ``op`` read ``tensor`` as input ``index`` (no public way to
    rewire an op; memsave only rewires ops it just made)."""
    op._update_input(index, tensor)  # pylint: disable=protected-access


def copy_gradient_function(source, target):
    """Give ``target`` the gradient function of ``source`` (a gradient_override_map's)."""
    target._gradient_function = source._gradient_function  # pylint: disable=protected-access


def set_gradient_function(op, function):
    """Give this one op the gradient ``function(op, *output_grads)``; no public
    API sets a gradient per op (tf.RegisterGradient is global, per type)."""
    op._gradient_function = function  # pylint: disable=protected-access


def gradient_override_name(op):
    """The gradient ``graph.gradient_override_map`` gave ``op`` (the name it is
    registered under), or None. ``tf.gradients`` honours it, the tape does not."""
    try:
        return op.get_attr("_gradient_op_type")
    except ValueError:
        return None


def same_gradient_function(a, b):
    """Whether ops ``a`` and ``b`` carry the same gradient override (or none)."""
    return a._gradient_function is b._gradient_function  # pylint: disable=protected-access


def create_op(graph, op_type, inputs, dtypes=None, **kwargs):
    """A new op in ``graph`` with explicit inputs, attrs and op_def.

    ``Graph.create_op`` is deprecated and applies the control-dependency
    and device stacks; memsave copies ops exactly (``compute_device=False``).
    """
    return graph._create_op_internal(op_type, inputs, dtypes=dtypes, **kwargs)  # pylint: disable=protected-access


def mutation_lock(graph):
    """The lock TF holds while it adds ops to ``graph`` (a context manager)."""
    return graph._mutation_lock()  # pylint: disable=protected-access


def graph_function(graph, name):
    """The function ``name`` registered in ``graph`` itself, or None."""
    return graph._get_function(name)  # pylint: disable=protected-access


def is_function_call(op):
    """Whether ``tf.gradients`` differentiates ``op`` as a function call.

    It does so even when ``op`` is in ``stop_gradients`` (its stop check only
    skips the registered gradient, not the SymbolicGradient of a call), so
    callers must not rely on that stop for such ops.
    """
    return (op.type in ("PartitionedCall", "StatefulPartitionedCall")
            or op.graph._is_function(op.type))  # pylint: disable=protected-access


def called_function(op):
    """The function a function call ``op`` runs (it has ``.graph`` and
    ``.name``), looked up in its graph and the graphs around it; None if not
    a call or not found."""
    if op.type in ("PartitionedCall", "StatefulPartitionedCall"):
        name = op.get_attr("f").name
    elif op.graph._is_function(op.type):  # pylint: disable=protected-access
        name = op.type
    else:
        return None
    graph = op.graph
    while graph is not None:
        function = graph._get_function(name)  # pylint: disable=protected-access
        if function is not None:
            return function
        graph = getattr(graph, "outer_graph", None)
    return None


def called_graph(op):
    """The FuncGraph a function call ``op`` runs (see :func:`called_function`);
    None if not a call or not found (a function loaded from a SavedModel has
    no graph)."""
    return getattr(called_function(op), "graph", None)


def graph_functions(graph):
    """The functions registered in ``graph`` itself (not its outer graphs)."""
    return list(graph._functions.values())  # pylint: disable=protected-access


def add_function(graph, function):
    """Register ``function`` and the functions it calls in ``graph``."""
    graph._add_function_recursive(function)  # pylint: disable=protected-access


def orders_stateful_ops_by_creation(graph):
    """True while ``graph`` is being traced with automatic control dependencies
    (a ``tf.function`` body): its stateful ops get ordered by creation."""
    return bool(getattr(graph, "_add_control_dependencies", False))


def in_v1_while_body(graph):
    """Whether ops built in ``graph`` now go into a TF1 while loop's body
    (``tf.compat.v1.disable_control_flow_v2()``): the loop's context holds
    them, and an op built outside it cannot read them."""
    context = graph._get_control_flow_context()  # pylint: disable=protected-access
    return containing_while_context(context) is not None


def ref_variable_tensor(variable):
    """The ref tensor of a TF1 reference variable (what tf.gradients differentiates)."""
    return variable._ref()  # pylint: disable=protected-access


def tape_handle(tape):
    """The C++ tape behind a ``tf.GradientTape`` (None once a non-persistent tape is used)."""
    return tape._tape  # pylint: disable=protected-access


def tape_recording(tape):
    """True inside the tape's ``with`` block (and not in stop_recording)."""
    return tape._recording  # pylint: disable=protected-access


def tape_persistent(tape):
    """True for a ``tf.GradientTape(persistent=True)``."""
    return tape._persistent  # pylint: disable=protected-access


def pause_tape(tape):
    """Stop ``tape`` recording, as its ``gradient()`` does when called inside the block."""
    tape._pop_tape()  # pylint: disable=protected-access


def release_tape(tape):
    """Forget the C++ tape after a non-persistent ``gradient()``, as TF does."""
    tape._watched_variables = tape._tape.watched_variables()  # pylint: disable=protected-access
    tape._tape = None  # pylint: disable=protected-access


# ---------------------------------------------------------------------------
# tf.gradients' forward reachability, same answer at a fraction of the cost.
#
# Each tf.gradients call first marks every op reachable from its xs
# (``_MarkReachedOps``), then keeps those that are also ancestors of its
# ys. Per tensor it passes, TF rebuilds the list of trainable dtypes and
# scans every capture of the enclosing FuncGraphs (hundreds: one per
# weight) for one that captured the tensor. A rewrite makes one call per
# segment, each walking from the weights through everything built so far:
# 70-85% of the build time of a 150-370 segment plan (DenseNet121,
# MobileNetV2). The replacement asks the same questions once per call and
# per dtype, and can leave out ops that are no ancestor of the ys (see
# fast_reachability); what TF keeps of the walk is the same.


def _mark_reached_ops(from_ops, reached_ops, func_graphs):
    """``_MarkReachedOps`` with captures looked up once per call, trainability
    once per dtype (a variant still asks per tensor), the ops of
    :func:`fast_reachability`'s ``skip`` and ``barred`` not entered, and its
    ``prunable`` ops told which inputs need no gradient."""
    captured = {id(outer) for func in func_graphs for outer, _ in func.captures}
    graph, lo, hi = _local_skip.__dict__.pop("skip", None) or (None, 0, 0)
    prunable = _local_skip.__dict__.pop("prunable", None)
    barred = _local_skip.__dict__.pop("barred", None) or ()
    per_dtype = {}
    queue = collections.deque(from_ops)
    starts = set(from_ops)
    passed = set()   # barred ops of xs, walked through (see fast_reachability)
    while queue:
        op = queue.popleft()
        if op in reached_ops or op in passed or (lo <= op._id < hi and op.graph is graph  # pylint: disable=protected-access
                                                 and op not in starts):
            continue
        if op in barred:
            if op not in starts:
                continue
            passed.add(op)   # an x's op: its consumers are reached, it is not
        else:
            reached_ops.add(op)
        for output in op.outputs:
            dtype = output.dtype
            trainable = per_dtype.get(dtype)
            if trainable is None:
                trainable = per_dtype[dtype] = (
                    None if dtype.base_dtype == tf.variant else is_trainable(dtype))
            if trainable is None:
                trainable = is_trainable(output)
            if not trainable:
                continue
            if id(output) in captured:
                queue.extend(consumers_across_captures(output, func_graphs))
            else:
                queue.extend(output.consumers())
    if prunable:
        _skip_unreached_inputs(prunable, reached_ops, starts)


# Their gradients (while_v2's) also read skip_input_indices, and rebuild the
# loop around what they skip: left to compute everything, as tf.gradients does.
_SKIP_UNTOUCHED = frozenset({"While", "StatelessWhile"})


def _skip_unreached_inputs(ops, reached, starts):
    """Give each of ``ops`` that the walk reached ``skip_input_indices``: its
    inputs whose gradients tf.gradients builds and then drops, as no
    gradient goes on from them: their ops were not reached (only reached
    ops are between the xs and the ys) or stop gradients.

    tf.GradientTape passes the same to gradient functions, which then leave
    out, e.g., a batch norm's gradients for its moving mean and for the
    stopped batch mean in its variance: 17% of the gradient ops that
    tf.gradients builds for MobileNetV2. A placeholder is kept, as it may
    stand for a captured tensor that TF follows outside, and so is a
    ``StopGradient`` among the walk's ``starts`` (an x's op: its gradient
    is asked for). Removed when the call ends (:func:`fast_reachability`).
    """
    marked = _local_skip.__dict__.setdefault("marked", [])
    for op in ops:
        if op not in reached or op.type in _SKIP_UNTOUCHED:
            continue
        skipped = tuple(i for i, t in enumerate(op.inputs)
                        if (t.op not in reached
                            or (t.op.type == "StopGradient" and t.op not in starts))
                        and t.op.type != "Placeholder")
        if skipped:
            op.skip_input_indices = skipped
            marked.append(op)


def _log_op_gradients(op, out_grads, in_grads):
    """TensorFlow's ``_LogOpGradients``, but not for a gradient with no name:
    TF formats every gradient's name whether or not it logs, and a value a
    custom gradient returns from outside the graph (an eager tensor it closed
    over, a numpy array, a number) has none, so tf.gradients failed where the
    tape (which does not log) runs."""
    if not all(_named(g) for g in (*out_grads, *in_grads)):
        return
    log_op_gradients(op, out_grads, in_grads)


def _named(grad):
    """Whether ``grad`` (None, a tensor, IndexedSlices, or a list of them) is
    a graph value with a name: not an eager tensor, a numpy array or a number
    a custom gradient returned."""
    if isinstance(grad, (list, tuple)):
        return all(_named(g) for g in grad)
    return grad is None or (isinstance(grad, (tf.Tensor, tf.IndexedSlices))
                            and not isinstance(grad, EagerTensor))


_reach_lock = threading.Lock()
_reach_users = [0]
_local_skip = threading.local()


@contextlib.contextmanager
def fast_reachability(skip=None, prunable=None, barred=None):
    """Within the block, tf.gradients walks with :func:`_mark_reached_ops`
    and logs with :func:`_log_op_gradients` (on every thread: the answers
    are TF's own, so other callers only gain).

    ``skip``: ``(graph, lo, hi)``, ops of ``graph`` with ids in ``[lo, hi)``
    that the next walk on this thread does not enter. The caller vouches
    that none of them is an ancestor of that call's ys: TF keeps only the
    reached ops that are, so its gradients are the same.
    ``prunable``: ops whose gradient functions, in the call after the next
    walk on this thread, skip the inputs no gradient is asked of (see
    :func:`_skip_unreached_inputs`). The caller made them for that call, so
    no other thread differentiates them meanwhile.
    ``barred``: ops that the next walk on this thread does not enter, so
    that call neither differentiates them nor what it reaches only through
    them (see :func:`memsave.rewrite.plain_gradients`' ``stops_hold``); one
    that makes an x is left out of the reached ops, its consumers not.
    """
    with _reach_lock:
        if not _reach_users[0]:
            gradients_util_module._MarkReachedOps = _mark_reached_ops  # pylint: disable=protected-access
            gradients_util_module._LogOpGradients = _log_op_gradients  # pylint: disable=protected-access
        _reach_users[0] += 1
    _local_skip.skip = skip
    _local_skip.prunable = prunable
    _local_skip.barred = barred
    try:
        yield
    finally:
        _local_skip.__dict__.pop("skip", None)
        _local_skip.__dict__.pop("prunable", None)
        _local_skip.__dict__.pop("barred", None)
        for op in _local_skip.__dict__.pop("marked", ()):
            del op.skip_input_indices
        with _reach_lock:
            _reach_users[0] -= 1
            if not _reach_users[0]:
                gradients_util_module._MarkReachedOps = mark_reached_ops  # pylint: disable=protected-access
                gradients_util_module._LogOpGradients = log_op_gradients  # pylint: disable=protected-access


SYMBOLS = tuple(_symbols)
_probes.clear()   # the scratch objects were only needed for the check


# ---------------------------------------------------------------------------
# Version check.

def _major_minor(version):
    return ".".join(str(version).split(".")[:2])


def check_version(version=None):
    """Warn (logger "memsave") when TensorFlow's major.minor is not TESTED_TF.

    Returns True when the version is the tested one.
    """
    version = _installed_version() if version is None else version
    if _major_minor(version) == TESTED_TF:
        return True
    logger.warning("memsave: TensorFlow %s is installed, but memsave is tested with "
                   "TensorFlow %s.x; every internal it needs is present, so it goes on, "
                   "but its results are not verified on this version", version, TESTED_TF)
    return False


check_version()
