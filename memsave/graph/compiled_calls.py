"""The scratch of an XLA-compiled call's gradient, from XLA's own buffer assignment.

A function compiled on its own inside a step that XLA does not compile
(``tf.function(jit_compile=True)`` called from the step; Keras compiles
grouped convolutions so on CPU) runs as one kernel, and its gradient as
another. The buffers XLA assigns inside them are allocated and freed within
the call, where no tensor of the planning graph shows them: ConvNeXtTiny's
last stage (768 channels at 4x4, batch 8) has activations under 1 MiB, and
its grouped convolution's gradient allocates a 220.5 MiB buffer (the meter
measured 221.7 MiB of scratch there). Unmodelled, a plan's first measured
step ran 42% over its budget.

So the call and its gradient are compiled once, ahead, on the call's shapes
(the forward op copied into a small jit-compiled function that returns its
gradients, for the default device), and XLA's temporary buffers are put on
the call's outputs as the scratch of their backward
(``TensorNode.scratch_bytes``). The forward runs in the same compilation, so
the figure is what the two need together, an upper bound on the gradient's
own. Results are kept per function body and shapes: a model's identical
layers compile once per process.

The probe runs in a thread of its own, eagerly, so that nothing of the
caller's (its gradient tapes, graph, scopes) reaches it: TensorFlow caches
a call's forward and backward functions the first time they are built, and
they must be built as the step itself would build them. Where the probe
cannot be built (an unknown shape, a variable that is no eager capture, as
in a ``tf.compat.v1`` Session's graph, eager execution off, or XLA refusing
the function), the scratch stays unknown (0) and a DEBUG log says so.
"""

import logging
import threading

import tensorflow as tf

from memsave import tf_internal
from memsave.graph.edit import copy_op

logger = logging.getLogger("memsave")

_CALLS = ("PartitionedCall", "StatefulPartitionedCall")
# Temp bytes per (function body, input shapes, differentiated outputs); bounded.
_KNOWN = {}
_KNOWN_MOST = 256


def is_compiled_call(op):
    """Whether ``op`` calls a function that XLA compiles on its own."""
    if op.type not in _CALLS:
        return False
    try:
        return bool(op.get_attr("_XlaMustCompile"))
    except ValueError:
        return False


def gradient_scratch(op, shape_of=None, differentiated=None):
    """Bytes XLA's buffer assignment gives the temporaries of ``op``'s forward
    and gradient compiled together; 0 where ``op`` is no compiled call or the
    figure cannot be had. ``shape_of(tensor)`` gives a tensor's shape (the
    planning graph's, where shape inference filled in unknown ones);
    ``differentiated(tensor)`` says which outputs a gradient reaches
    (default: those some op reads; a y is read by none). The probe runs in a
    thread of its own (see the module's docstring).
    """
    if not is_compiled_call(op):
        return 0
    box = {}

    def run():
        try:
            box["found"] = _scratch(op, shape_of or (lambda t: t.shape),
                                    differentiated or (lambda t: bool(t.consumers())))
        except Exception as e:  # pylint: disable=broad-except
            box["error"] = e

    worker = threading.Thread(target=run, name="memsave-xla-probe")
    worker.start()
    worker.join()
    error = box.get("error")
    if isinstance(error, _Unknown):
        logger.debug("memsave: %s: its XLA-compiled gradient's scratch is not modelled: %s",
                     op.name, error)
        return 0
    if error is not None:
        # A probe must never fail the user's step: its scratch stays unknown.
        logger.debug("memsave: %s: no probe of its XLA-compiled gradient (%s: %s); its "
                     "scratch is not modelled", op.name, type(error).__name__, error)
        return 0
    found = box["found"]
    if found:
        logger.debug("memsave: %s: its XLA-compiled gradient allocates %d bytes of scratch",
                     op.name, found)
    return found


def _scratch(op, shape_of, differentiated):
    """:func:`gradient_scratch`'s figure, in the probe's thread."""
    if not tf.executing_eagerly():
        raise _Unknown("eager execution is off, and XLA compiles ahead only eagerly")
    probe = _Probe(op, shape_of, differentiated)
    found = _KNOWN.get(probe.key)
    if found is None:
        try:
            found = probe.temp_bytes()
        except Exception as e:  # pylint: disable=broad-except
            logger.debug("memsave: %s: compiling its gradient for its scratch failed (%s: %s); "
                         "not modelled", op.name, type(e).__name__, e)
            found = 0   # kept too: identical calls would fail alike
        _KNOWN[probe.key] = found
        while len(_KNOWN) > _KNOWN_MOST:
            _KNOWN.pop(next(iter(_KNOWN)))
    return found


class _Unknown(Exception):
    """Why a call's gradient cannot be compiled ahead."""


class _Probe:
    """What compiling ``op`` and its gradient ahead needs: input specs (or the
    eager variable handles it captured), the differentiated outputs, a key."""

    def __init__(self, op, shape_of, differentiated):
        self.op = op
        function = tf_internal.called_function(op)
        if function is None:
            raise _Unknown("its function is not in its graph's library or its outer graphs'")
        self.function = function
        captured = {inner.ref(): outer for outer, inner in getattr(op.graph, "captures", ())}
        self.specs, self.handles = [], {}
        for i, t in enumerate(op.inputs):
            if t.dtype == tf.resource:
                outer = captured.get(t.ref())
                if not isinstance(outer, tf_internal.EagerTensor):
                    raise _Unknown("input %d is a variable that is no eager capture" % i)
                self.handles[i] = outer
            else:
                self.specs.append(self._spec(t, shape_of))
        self.outputs = [t for t in op.outputs if t.dtype.is_floating and differentiated(t)]
        if not self.outputs:
            raise _Unknown("no output is differentiated")
        self.grad_specs = [self._spec(t, shape_of) for t in self.outputs]
        # Keras captures a layer's input and kernel in either order: the
        # inputs are keyed as a multiset. A variable's shape is its value's
        # (its static shape may leave an axis unknown).
        variables = sorted(tuple(tf.raw_ops.VariableShape(input=h, out_type=tf.int64).numpy())
                           for h in self.handles.values())
        self.key = (_body_key(function),
                    tuple(sorted((s.dtype.name, tuple(s.shape.as_list())) for s in self.specs)),
                    tuple(variables), tuple(t.value_index for t in self.outputs),
                    tuple(self.grad_specs), op.device)

    @staticmethod
    def _spec(t, shape_of):
        shape = tf.TensorShape(shape_of(t))
        if not shape.is_fully_defined():
            raise _Unknown("%s has the unknown shape %s" % (t.name, shape))
        return tf.TensorSpec(shape, t.dtype)

    def temp_bytes(self):
        op, function, handles, outputs = self.op, self.function, self.handles, self.outputs

        def differentiated(*args):
            graph = tf.compat.v1.get_default_graph()
            tf_internal.add_function(graph, function)
            args = iter(args)
            inputs = [graph.capture(handles[i]) if i in handles else next(args)
                      for i in range(len(op.inputs))]
            grad_ys = list(args)
            copy = copy_op(graph, op, inputs, "memsave_probe")
            # TensorFlow's own gradients, below memsave.patch()'s patch points.
            with tf_internal.mutation_lock(graph):
                grads = tf_internal.gradients_helper(
                    [copy.outputs[t.value_index] for t in outputs], inputs, grad_ys)
            return [g for g in grads if g is not None]

        compiled = tf.function(differentiated, jit_compile=True, autograph=False)
        ir = compiled.experimental_get_compiler_ir(*(self.specs + self.grad_specs))
        return tf_internal.xla_temp_bytes(ir(stage="optimized_hlo_proto_serialized"))


def _body_key(function):
    """What the compiled function computes, up to names: its ops in order, each
    with its attributes (less TensorFlow's own, named with a leading '_'),
    its inputs as (position among the ops, output index), its control inputs
    as a set (automatic control dependencies list them in no fixed order) and
    its output shapes; the arguments are told apart by dtype and shape only,
    since Keras captures a layer's input and kernel in either order.
    Identical layers' calls get one key."""
    body = getattr(function, "graph", None)
    if body is None:   # no graph (a loaded function): its definition, names and all
        return function.definition.SerializeToString(deterministic=True)
    position, parts = {}, []
    for inner in body.get_operations():
        if inner.type == "Placeholder":
            t = inner.outputs[0]
            position[inner] = ("arg", t.dtype.name, str(t.shape))
            continue
        position[inner] = len(parts)
        attrs = tuple(sorted((k, v.SerializeToString(deterministic=True))
                             for k, v in inner.node_def.attr.items() if not k.startswith("_")))
        parts.append((inner.type, attrs, tuple((position.get(t.op), t.value_index)
                                               for t in inner.inputs),
                      tuple(sorted((str(position.get(c)) for c in inner.control_inputs))),
                      tuple(str(t.shape) for t in inner.outputs)))
    return tuple(parts)
