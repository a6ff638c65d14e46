"""Which ops must never be recomputed.

Recomputing a stateful random op draws a new sample (unseeded dropout would
use a different mask in the backward pass), a ``tf.random.Generator`` read
advances its state again, and a Python function may have side effects. Such
ops are *pinned*: the rewriter keeps their outputs as checkpoints instead of
copying them. Unknown stateful ops are pinned too; being wrong that way only
costs memory, never correctness.
"""

from memsave import tf_internal
from memsave.graph import functions, optable
from memsave.graph.walk import forward_ops

# Stateful ops that are safe to run again within the same step (inside a
# function body, where they run in the same op as their gradient's reads).
RECOMPUTABLE_STATEFUL = frozenset({
    "ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VariableShape",
    "VarIsInitializedOp", "Assert",
})

# Top-level reads of a variable (its value, its shape), the non-writing
# consumers of its handle: never recomputed (see is_pinned). A variable made
# with an unknown shape may be assigned a value of another shape in the step,
# and a VariableShape run again then reads the new shape (a Session's update
# raced with the recomputation: gradients 0.74 of the largest entry off
# plain's in 22 of 30 runs).
VARIABLE_READS = frozenset({"ReadVariableOp", "ResourceGather", "ResourceGatherNd",
                            "VariableShape", "VarIsInitializedOp"})

# Ops declared stateless that still must not run twice.
ALWAYS_PINNED = frozenset({"PyFunc", "PyFuncStateless", "EagerPyFunc"})

# A Session may feed it: its output is then the fed value, a copy's the default.
FEEDABLE = "PlaceholderWithDefault"

# Ops declared stateless that draw new random values, and when they do not
# (``attrs``: the NodeDef's). A fractional pool picks new pooling windows at
# every run unless ``deterministic`` is set, and then draws its windows once
# per node unless a seed is given: a copy is a new node, so with ``seed=0``
# (``tf.nn.fractional_max_pool``'s default) it pools over other windows than
# the forward op. An extracted glimpse fills pixels outside the image with
# new noise at every run unless ``noise`` is 'zero'.
def _seeded_pool(attrs):
    return ("deterministic" in attrs and attrs["deterministic"].b
            and any(k in attrs and attrs[k].i for k in ("seed", "seed2")))


def _zero_noise(attrs):
    return "noise" in attrs and attrs["noise"].s == b"zero"


_RANDOM_UNLESS = {"FractionalMaxPool": _seeded_pool, "FractionalAvgPool": _seeded_pool,
                  "ExtractGlimpse": _zero_noise, "ExtractGlimpseV2": _zero_noise}

# Ops declared stateless that write their first input's buffer in place
# (``tf.raw_ops.InplaceAdd``, behind ``inplace_ops.inplace_add``'s DeepCopy):
# a copy would add into the kept buffer a second time.
WRITE_THEIR_INPUT = frozenset({"InplaceAdd", "InplaceSub", "InplaceUpdate"})


def never_run_twice(op_type, attrs):
    """Whether an op of ``op_type`` with NodeDef attributes ``attrs`` must not
    run again or be copied, although TensorFlow declares it stateless: a
    Python function, random without state, or a write to its input."""
    if op_type in ALWAYS_PINNED or op_type in WRITE_THEIR_INPUT:
        return True
    deterministic = _RANDOM_UNLESS.get(op_type)
    return deterministic is not None and not deterministic(attrs)

# Ops whose function attributes hold bodies we inspect instead of the op flag.
FUNCTION_CALLS = frozenset({
    "If", "StatelessIf", "While", "StatelessWhile", "Case", "StatelessCase",
    "PartitionedCall", "StatefulPartitionedCall",
})

# Ops whose output is their input's resource handle, unchanged (output i is
# input i): a read or a write through one reaches the same variable.
FORWARDS_HANDLE = frozenset({"Identity", "IdentityN"})


def handle_root(t):
    """The resource handle ``t`` is, through the identities that forward it
    (``tf.identity(v.handle)`` is ``v.handle``)."""
    while (t.dtype.name == "resource" and t.op.type in FORWARDS_HANDLE
           and len(t.op.inputs) > t.value_index):
        t = t.op.inputs[t.value_index]
    return t


def handle_users(t):
    """The ops that use the variable whose handle ``t`` is, through ``t``'s root
    or any identity of it (the identities themselves left out)."""
    users, stack, seen = [], [handle_root(t)], set()
    while stack:
        h = stack.pop()
        if h.ref() in seen:
            continue
        seen.add(h.ref())
        for c in h.consumers():
            if c.type in FORWARDS_HANDLE:
                stack.extend(out for i, out in enumerate(c.outputs)
                             if i < len(c.inputs) and c.inputs[i] is h)
            else:
                users.append(c)
    return users

# Non-writing consumers of a TF1 reference variable (``use_resource=False``).
_REF_READERS = frozenset({"Identity", "IsVariableInitialized"})


def _is_ref(t):
    """Whether ``t`` is a TF1 reference variable's ref tensor (a ref dtype)."""
    return t.dtype != t.dtype.base_dtype


def _buffer_sources(t):
    """``t`` and every tensor whose buffer ``t`` may be, found back through
    what may hand a buffer on (:data:`memsave.graph.optable.MAY_SHARE_INPUT`);
    a ref ends the walk (its variable owns the buffer)."""
    stack, seen = [t], set()
    while stack:
        t = stack.pop()
        if t.ref() in seen:
            continue
        seen.add(t.ref())
        yield t
        if not _is_ref(t) and t.op.type in optable.MAY_SHARE_INPUT:
            stack.extend(reversed(t.op.inputs))


def ref_variables(t, facts=None):
    """The TF1 reference variables (their variable ops' ref tensors) whose
    buffer ``t`` may be, in the order found: a ref (the variable's, or one
    an assign returns) is its variable's; its snapshot read (an Identity)
    forwards the buffer, so an in-place assign made later changes what a
    copy reading it sees; and so may any op that can hand an input's buffer
    on (``tf.identity(v)``, a reshape, a full slice: see
    :func:`_buffer_sources`)."""
    return list((facts or BufferFacts()).of(t)[0])


class BufferFacts:
    """Of the buffers tensors of one graph may be, as it stands: their TF1
    reference variables (:func:`ref_variables`), and whether an op declared
    stateless writes one in place (:data:`WRITE_THEIR_INPUT`, e.g.
    ``InplaceUpdate`` on a kept matmul output: a copy reading it after that
    write would see the new values); each tensor's worked out once from its
    inputs'.

    Walked afresh per tensor, the buffers behind a DenseNet's concatenations
    (each may hand on the previous one's) made the analysis quadratic in
    depth. Where the walk meets a cycle (a TF1 loop's Merge and
    NextIteration) the tensor is walked whole and nothing is remembered.
    """

    def __init__(self):
        self._known = {}   # ref -> (ref variables found, written in place)

    def of(self, t):
        """``(ref variables, written in place)`` of ``t``'s possible buffers."""
        found = self._known.get(t.ref())
        if found is None:
            fresh = self._derived(t)
            if fresh is None:   # a cycle: the whole walk, as it was
                found = self._walked(t)
            else:
                self._known.update(fresh)
                found = fresh[t.ref()]
        return found

    def _derived(self, t):
        """The facts of ``t`` and of the tensors it may share a buffer with
        that are not known yet, each from its own and its inputs'; None where
        a tensor may share a buffer with itself."""
        fresh, open_ = {}, set()
        stack = [(t, False)]
        while stack:
            u, inputs_done = stack.pop()
            key = u.ref()
            if key in self._known or key in fresh:
                continue
            inputs = _shared_inputs(u)
            if not inputs_done:
                if key in open_:
                    return None
                open_.add(key)
                stack.append((u, True))
                stack.extend((i, False) for i in reversed(inputs))
                continue
            open_.discard(key)
            roots = [_ref_root(u)] if _is_ref(u) else []
            written = _written_directly(u)
            for i in inputs:
                i_roots, i_written = self._known.get(i.ref()) or fresh[i.ref()]
                _add_new(roots, i_roots)
                written = written or i_written
            fresh[key] = (tuple(roots), written)
        return fresh

    @staticmethod
    def _walked(t):
        roots, written = [], False
        for s in _buffer_sources(t):
            if _is_ref(s):
                _add_new(roots, [_ref_root(s)])
            written = written or _written_directly(s)
        return tuple(roots), written


def _add_new(found, tensors):
    """Append to ``found`` the ``tensors`` not already in it (by identity)."""
    for t in tensors:
        if all(t is not f for f in found):
            found.append(t)


def _shared_inputs(t):
    """The inputs whose buffer ``t`` may be (see :func:`_buffer_sources`)."""
    if _is_ref(t) or t.op.type not in optable.MAY_SHARE_INPUT:
        return ()
    return tuple(t.op.inputs)


def _written_directly(t):
    return any(c.type in WRITE_THEIR_INPUT and c.inputs[0] is t for c in t.consumers())


def _ref_root(ref):
    """The variable op's ref tensor behind ``ref``: an op with a ref output
    (``Assign``, ``ScatterAdd``) returns the ref of its first input."""
    while ref.op.inputs and _is_ref(ref.op.inputs[0]):
        ref = ref.op.inputs[0]
    return ref


def ref_writers(ref):
    """The ops that may write the reference variable whose ref tensor ``ref``
    is: the consumers of it, or of a ref an op returns for it (an assign's),
    other than its reads."""
    writers, stack, seen = [], [ref], set()
    while stack:
        r = stack.pop()
        if r.ref() in seen:
            continue
        seen.add(r.ref())
        for c in r.consumers():
            if c.type in _REF_READERS:
                continue
            writers.append(c)
            if c.inputs and c.inputs[0] is r:
                stack.extend(out for out in c.outputs if _is_ref(out))
    return list(dict.fromkeys(writers))


def _function_names(node_attrs):
    for value in node_attrs.values():
        if value.HasField("func"):
            yield value.func.name
        elif value.HasField("list"):
            for f in value.list.func:
                yield f.name


def _find_function(graph, name):
    # Bodies may be registered in an enclosing graph of a FuncGraph.
    while graph is not None:
        fn = tf_internal.graph_function(graph, name)
        if fn is not None:
            return fn
        graph = getattr(graph, "outer_graph", None)
    return None


def function_nodes(graph, names, seen=None):
    """The NodeDefs of the functions ``names`` and of every function they
    call, bodies of nested control flow included. A call (or control-flow)
    node is replaced by the nodes of what it runs; ``None`` stands for a
    function that cannot be found (callers must then assume the worst)."""
    seen = set() if seen is None else seen
    for name in names:
        if name in seen:
            continue
        seen.add(name)
        fn = _find_function(graph, name)
        if fn is None:
            yield None
            continue
        fdef = fn.cached_definition if hasattr(fn, "cached_definition") else fn.definition
        for node in fdef.node_def:
            if tf_internal.get_op_def(node.op) is None:   # a library function called by name
                yield from function_nodes(graph, [node.op, *_function_names(node.attr)], seen)
            elif node.op in FUNCTION_CALLS:
                yield from function_nodes(graph, _function_names(node.attr), seen)
            else:
                yield node


def body_nodes(op):
    """:func:`function_nodes` of every function ``op`` runs (its bodies, its callee)."""
    return function_nodes(op.graph, _function_names(op.node_def.attr))


def _body_is_pinned(graph, names):
    for node in function_nodes(graph, names):
        if node is None or never_run_twice(node.op, node.attr):
            return True   # unknown body: be safe
        op_def = tf_internal.get_op_def(node.op)
        if op_def is not None and op_def.is_stateful and node.op not in RECOMPUTABLE_STATEFUL:
            return True
    return False


def written_handles(graph, region_ops):
    """``{handle ref: order}`` for resource handles a later op may write (a
    TF1 reference variable's readers are always pinned: see :func:`is_pinned`).

    ``order`` is the creation id of the latest writer, or infinity for a
    writer that runs after ``region_ops``; a reader created before it may
    see a different value when recomputed.

    Only such writes can change a variable between a forward read and its
    recomputation. In a plain graph that is a write downstream of the region
    (writes that do not depend on it, like initializers, run outside the step
    or before the read), and for the handles a call or control-flow op reads,
    a write not made yet (see :func:`_read_by_calls`). In a ``tf.function``
    the ordering edges do not exist yet when gradients are built: automatic
    control dependencies later order every op touching a resource by
    creation, so a write created after a reader runs after it, and a copy of
    the reader created now would run after the write and read the new value.
    There the writer's id decides (see :func:`is_pinned`).
    """
    written = {} if _orders_by_creation(graph) else _read_by_calls(region_ops)
    writers = {}
    for op in graph.get_operations():
        for t in op.outputs:
            if t.dtype.name != "resource":
                continue
            root = handle_root(t).ref()   # a write through an identity writes the root's
            for consumer in t.consumers():
                if consumer.type in VARIABLE_READS or consumer.type in FORWARDS_HANDLE:
                    continue
                if consumer.type in FUNCTION_CALLS and not _body_is_pinned(
                        graph, _function_names(consumer.node_def.attr)):
                    continue  # a body with only recomputable ops just reads
                writers.setdefault(consumer, []).append(root)
    if not writers:
        return written
    if _orders_by_creation(graph):
        after = {op: tf_internal.op_id(op) for op in writers}
    else:
        downstream = forward_ops(region_ops, control=True)
        after = {op: float("inf") for op in writers if op in downstream}
    for op, order in after.items():
        for ref in writers[op]:
            written[ref] = max(written.get(ref, order), order)
    return written


def _read_by_calls(region_ops):
    """``{handle ref: infinity}`` for the resource handles that a call or
    control-flow op of the region reads, in a graph that does not order
    stateful ops by creation (a ``tf.compat.v1`` graph run by a Session).

    There a write made after the gradients, such as an optimizer's
    ``apply_gradients``, runs in the same ``Session.run`` ordered by nothing
    but its own gradient: that of a variable read near the ys is ready
    early, and its update ran before the backward pass recomputed a
    ``tf.cond`` that reads the variable in its body, which then computed
    with the new value (gradients 1.8% of the largest entry off plain's,
    silently). No such write exists yet when the rewrite looks, so every
    handle such an op reads counts as written later, and the op is pinned.
    (A top-level variable read is always pinned, see :func:`is_pinned`.)
    """
    return {handle_root(t).ref(): float("inf") for op in region_ops if op.type in FUNCTION_CALLS
            for t in op.inputs if t.dtype.name == "resource"}


def _orders_by_creation(graph):
    """True for graphs whose stateful ops get ordered by creation later (tf.function)."""
    return tf_internal.orders_stateful_ops_by_creation(graph)


def is_pinned(op, written=None, facts=None):
    """True if ``op`` must not be recomputed.

    ``written`` is :func:`written_handles`' map; a control-flow or call op
    reading a variable that a later op writes is pinned. ``facts``: a
    :class:`BufferFacts` shared by the calls on one graph.
    """
    if never_run_twice(op.type, op.node_def.attr):
        return True
    if op.type == FEEDABLE and not isinstance(op.graph, tf_internal.FuncGraph):
        return True
    written, facts = written or {}, facts or BufferFacts()
    if any(roots or written_now for roots, written_now in map(facts.of, op.inputs)):
        # A TF1 reference variable's buffer: an assign in place after the
        # forward read, which may be made after the gradients (an optimizer's
        # apply, fetched in the same run), changes what a copy would read
        # (weights 0.85-1.9 of their largest entry off plain's after two
        # steps of GradientDescent, where a weight was also read behind a
        # stop_gradient). Resource variables copy on write instead. The same
        # for a buffer an op declared stateless writes in place.
        return True
    if op.type in VARIABLE_READS:
        # Never re-read a variable in the backward pass: inside tf.function an
        # optimizer update in the same step may run before the re-read
        # (Grappler can drop the ordering edge), and the recomputation would
        # use new weights. The forward read aliases the variable's buffer, so
        # keeping it costs no activation memory.
        return True
    if functions.has_bodies(op) and not functions.copyable(op):
        return True
    if op.type in FUNCTION_CALLS:
        # A handle reaches a call as itself or through identities of it.
        if any(t.dtype.name == "resource"
               and written.get(handle_root(t).ref(), -1) > tf_internal.op_id(op)
               for t in op.inputs):
            return True
        return _body_is_pinned(op.graph, _function_names(op.node_def.attr))
    return op.op_def.is_stateful and op.type not in RECOMPUTABLE_STATEFUL
