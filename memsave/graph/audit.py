"""A static audit of a rewritten backward pass against ``tf.gradients``.

The rewrite splits backprop into segments: each copies part of the forward
pass, calls ``tf.gradients`` on the copy and hands running sums on to the
next. A mistake anywhere (a read nobody asked for, a kept op whose input was
forgotten, a sum added twice) gives wrong gradients without an error. The
audit checks the result, not the rewriter's reasoning: the :class:`Ledger`
only records facts as they happen (which op is a copy of which, which
identities memsave inserted, which ``tf.gradients`` calls were made and
what they returned), and :func:`check` derives everything else from the
graph, with a model of what ``tf.gradients`` does in each call (the ops it
differentiates: between its xs and ys, stopping at its stop_gradients and
at xs with nothing upstream, yet differentiating function calls even
there, as TensorFlow does).

What must hold:

* **Every path counted once.** For every op of the original graph that
  plain backprop differentiates, the gradient arriving along each of its
  live output edges (and a y's own seed) reaches exactly one
  differentiation of that op (a copy of it, or the op itself when it is
  kept), either within one call or through a checkpoint's running sum
  (followed through the sums themselves); each such differentiation sends
  gradient along every live input edge, and along none that plain
  backprop would not use. Each x's result holds exactly the gradients
  that arrive at it. A path on which TensorFlow's own gradient functions
  return None (Floor-like ops) is not followed further. An op that runs a
  gradient a user wrote, which need not be linear in its output gradient,
  is differentiated once.
* **Copies compute what their originals do**: same type, device and
  gradient function, inputs carrying the same values, control-flow bodies
  deep-copied with the same captures (checked when the copies are made,
  before differentiation rewrites any body).
* **Nothing recomputed may have changed**: no copy of a stateful op, and no
  copy reading a resource that an op may write between the forward read
  and the recomputation (in a ``tf.function``: a writer created after the
  original; in a plain graph: a writer downstream of the region, and for a
  call or control-flow op, any writer, since an optimizer's update made
  after the gradients runs in the same ``Session.run``).
* **Segments are fenced**: an op built for one segment reads what an
  earlier segment built only through a fence (see
  :func:`memsave.graph.edit.fence`) or another identity memsave inserted
  (a swap-in shared by nearby segments), else a fusion could close a cycle.
* **Waits are fenced**: an op memsave built itself (a copy, a join, a gate,
  a swap-in) waits (control input) for an op of the graph as it was only
  where its original does. A wait on a
  forward op itself (a y) is one Grappler may hand down to that op's
  inputs when the step does not use its value, and a fusion of such an
  input (a kept convolution) with a copy that reads it is then a cycle.

A violation raises :class:`memsave.errors.GradientMismatchError` naming
the edge or op. The audit adds no op to the graph: it costs build time
only.
"""

import bisect
import collections
import heapq

import tensorflow as tf

from memsave import tf_internal
from memsave.errors import GradientMismatchError
from memsave.graph import functions, stateful
from memsave.graph.walk import carries_gradient, components

# Sum ops the rewrite builds between segments (see memsave.rewrite.aggregate):
# an x's result or a checkpoint's seed is followed through them to the
# gradient calls that made its terms.
_SUM_TERMS = {
    "AddN": lambda op: list(op.inputs),
    "ConcatV2": lambda op: list(op.inputs[:-1]),          # IndexedSlices values
    "UnsortedSegmentSum": lambda op: [op.inputs[0]],     # IndexedSlices densified
}

_SEED = "seed"


def next_op_id(graph):
    """A bound on the ids of ops made from now on (ids grow with creation)."""
    ops = graph.get_operations()
    return tf_internal.op_id(ops[-1]) + 1 if ops else 0


class _Call:
    def __init__(self, index, ys, grad_ys, xs, stops, outputs, start):
        self.index, self.ys, self.grad_ys, self.xs = index, ys, grad_ys, xs
        self.stops, self.outputs, self.start = stops, outputs, start
        self.end = None     # the first op id after the call's ops
        self.sending = set()


class Ledger:
    """What a rewrite built, recorded as it happens (facts, not reasons)."""

    def __init__(self, graph, stops_hold=False):
        self.graph = graph
        # The gradient calls do not differentiate function calls that make a
        # stop (see memsave.rewrite.plain_gradients), where TF would.
        self.stops_hold = stops_hold
        self.first_new = next_op_id(graph)      # ids of ops made after this point
        self.copy_of = {}                       # copy op -> original op
        self.through = set()                    # identities memsave inserted
        self.fences = set()
        self.calls = []
        self.seeds = {}                         # seed tensor ref -> y name
        self.zeros = set()                      # refs of zeros given to unconnected xs
        self.spans = []                         # first op id of each segment
        # Ops made during a gradient call that none of its results depend on:
        # another replica's, whose thread built them while this one waited in
        # a cross-replica call, or the call's own that never run (see
        # memsave.rewrite._Rewrite._own).
        self.foreign = set()
        self.problems = []

    def segment(self):
        """A new segment starts: ops made from now on belong to it."""
        self.spans.append(next_op_id(self.graph))

    def copied(self, copies):
        """Record a :class:`memsave.graph.edit.Copies` and check its fidelity now,
        before any gradient rewrites a control-flow body."""
        for original, copy in copies.of.items():
            self.copy_of[copy] = original
        # The gates some copies read through.
        self.inserted([op.outputs[0] for op in copies.made if op not in self.copy_of])
        for original, copy in copies.of.items():
            self.problems.extend(_fidelity(original, copy, self))

    def inserted(self, tensors, fence=False):
        """Identities memsave put between a tensor and its readers (shields,
        swap-outs and swap-ins, fences, XLA barriers). Checked, not trusted:
        each must pass its inputs through unchanged (output i is input i), and
        a fence must be an Identity that Grappler keeps."""
        for t in components(tensors):
            if t.op.type not in _PASS_THROUGH or (fence and t.op.type != "Identity"):
                self.problems.append("%s stands between a tensor and its readers but is a "
                                     "%s, not an Identity" % (t.op.name, t.op.type))
                continue
            self.through.add(t.op)
            if fence:
                if _kept_by_grappler(t.op):
                    self.fences.add(t.op)
                else:
                    self.problems.append("the fence %s is not kept by Grappler" % t.op.name)

    def seed(self, tensor, y):
        """``tensor`` is (part of) the initial gradient of the y ``y``."""
        if tensor is not None:
            t = tensor.values if isinstance(tensor, tf.IndexedSlices) else tensor
            self.seeds[t.ref()] = y.name

    def unconnected(self, zeros):
        """``zeros`` stands for no gradient (``unconnected_gradients='zero'``)."""
        self.zeros.add(zeros.ref())

    def call(self, ys, grad_ys, xs, stops, outputs, start):
        """A ``tf.gradients(ys, xs, grad_ys, stop_gradients=stops)`` whose ops
        have ids from ``start`` on, which returned ``outputs``."""
        self.calls.append(_Call(len(self.spans) - 1, list(ys), grad_ys, list(xs), list(stops),
                                list(outputs), start))
        self.calls[-1].end = next_op_id(self.graph)

    # -- mapping what a call saw back to the original graph

    def original_op(self, op):
        if op in self.copy_of:
            return self.copy_of[op]
        return op if tf_internal.op_id(op) < self.first_new else None

    def original_tensor(self, t):
        """The original tensor whose value ``t`` carries, or None."""
        while t.op in self.through:
            t = _passed_through(t)
        op = self.original_op(t.op)
        return None if op is None else op.outputs[t.value_index]


# Ops whose output i is their input i: what memsave may insert between a
# tensor and its readers.
_PASS_THROUGH = frozenset({"Identity", "XlaOptimizationBarrier"})


def _passed_through(t):
    """The input an inserted pass-through op forwards as ``t``."""
    return t.op.inputs[t.value_index]


def _kept_by_grappler(op):
    try:
        return bool(op.get_attr("_grappler_do_not_remove"))
    except ValueError:
        return False


# ---------------------------------------------------------------------------
# The model of one tf.gradients call.

class _Flow:
    """Which ops ``tf.gradients(ys, xs, stop_gradients=stops)`` differentiates,
    among ops with ids below ``limit``, and along which input edges.

    ``edges`` lists ``(input tensor, op, input index)`` for each op that
    sends gradient to its inputs, for inputs that carry gradient and lie
    between xs and ys (or are xs), but not the other outputs of an op that
    makes an x and is not differentiated (:meth:`_stops`). ``sending`` is
    the set of those ops. With ``stops_hold`` a function call making a stop
    is not differentiated, nor reached unless it makes an x (see
    :func:`memsave.rewrite.plain_gradients`).
    """

    def __init__(self, ys, xs, stops, limit, stops_hold=False):
        self.limit = limit
        self.xs = {x.ref() for x in xs}
        self._from = {x.op for x in xs}
        self._barred = ({t.op for t in stops if tf_internal.is_function_call(t.op)}
                        if stops_hold else set())
        self._reached = {}
        stop_ops = {t.op for t in stops}
        self.edges, self.sending, self.seeded = [], set(), []
        heap, active = [], set()
        for y in ys:
            if self.reached(y.op) and y.op not in active:
                active.add(y.op)
                heapq.heappush(heap, (-tf_internal.op_id(y.op), y.op))
        for y in ys:
            self.seeded.append(self.reached(y.op))
        while heap:
            _, op = heapq.heappop(heap)
            if op in self._barred:
                continue   # an x's op, reached but not differentiated
            stopped = op in stop_ops or self._stops(op)
            if not (tf_internal.is_function_call(op) or (not stopped and _has_gradient(op))):
                continue
            self.sending.add(op)
            for i, t in enumerate(op.inputs):
                if not carries_gradient(t):
                    continue
                between = self.reached(t.op)
                if not (t.ref() in self.xs or (between and not self._stops(t.op))):
                    # Into another output of an x's op that sends nothing on
                    # (one piece of a split as an x): TF computes it, and drops it.
                    continue
                self.edges.append((t, op, i))
                if between and t.op not in active:
                    active.add(t.op)
                    heapq.heappush(heap, (-tf_internal.op_id(t.op), t.op))

    def leads_to_an_x(self, op, i):
        """Whether a gradient sent along ``op``'s input ``i`` can reach an x: the
        input is one, or is downstream of one along tensors that carry a
        gradient. A segment asks for the gradient of every checkpoint it
        reads, also one computed only from shapes (a cast of a variable's
        size, the zeros of a first-order gradient): it stops there, as
        nothing carries it on."""
        if i >= len(op.inputs):
            return True   # an input TensorFlow added to another image of the op
        t = op.inputs[i]
        return t.ref() in self.xs or (self.reached(t.op) and not self._stops(t.op))

    def _stops(self, op):
        """Whether ``op`` makes an x and reads nothing downstream of one:
        tf.gradients does not differentiate it (its 'stop ops'), so what
        arrives at its other outputs goes no further."""
        return op in self._from and not any(self.reached(t.op) for t in op.inputs)

    def reached(self, op):
        """Whether ``op`` is downstream of an x's op (TensorFlow's 'reached'),
        through ops made before ``limit``: walked up from ``op``, remembered.

        A TF1 while loop upstream of the region is a cycle (NextIteration
        feeds Merge): an op met again while its own walk is under way counts
        as not reached there, so the walk ends. No x reaches such a loop (one
        between xs and ys is refused before any rewrite), so the answer holds.
        """
        memo = self._reached
        if op in memo:
            return memo[op]
        stack, entered = [op], set()
        while stack:
            cur = stack[-1]
            if cur in memo:
                stack.pop()
                continue
            if cur in self._from or cur in self._barred:
                memo[cur] = cur in self._from
                stack.pop()
                continue
            # As tf.gradients marks ops reached: along tensors that carry a
            # gradient (not a shape: while_v2's accumulators of a loop over
            # an unknown batch take their element shape from one).
            parents = [t.op for t in cur.inputs if tf_internal.op_id(t.op) < self.limit
                       and carries_gradient(t)]
            if cur not in entered:
                entered.add(cur)
                todo = [p for p in parents if p not in memo and p not in entered]
                if todo:
                    stack.extend(todo)
                    continue
            memo[cur] = any(memo.get(p, False) for p in parents)
            stack.pop()
        return memo[op]


def _has_gradient(op):
    try:
        return tf_internal.get_gradient_function(op) is not None
    except LookupError:
        return False


# ---------------------------------------------------------------------------
# The checks.

def _edge_name(op, i):
    if i >= len(op.inputs):   # an input TensorFlow added to another image of the op
        return "input %d of %s (it has %d)" % (i, op.name, len(op.inputs))
    return "%s -> %s (input %d)" % (op.inputs[i].name, op.name, i)


class _Accounts:
    """Gradient arrivals, per place they land, as multisets of tokens.

    A token is ``(edge, sender)``: the gradient sent along an original edge
    ``(consumer op name, input index)`` by one differentiation ``sender``
    (``(call index, image op name)``) of the consumer. When an op is
    recomputed in several segments, each differentiation handles part of
    its output gradient (a partition of its output edges, checked at that
    op) and sends its part along every input edge: each part is one token.
    A y's seed is the token ``((SEED, y name), None)``.
    """

    def __init__(self):
        self.carried = {}                         # (call, target ref) -> Counter
        self.consumed = collections.defaultdict(collections.Counter)   # (call, op) -> Counter
        self.inputs = collections.defaultdict(set)                     # (call, op) -> {i}
        self.vanished = collections.Counter()    # tokens of paths that returned None


def check(ledger, region, results, user_stops):
    """Raise GradientMismatchError unless the rewrite ``ledger`` recorded
    computes ``tf.gradients(region.ys, region.xs)``' gradients ``results``."""
    problems = list(ledger.problems)
    plain = _Flow(region.ys, region.xs, user_stops, ledger.first_new, ledger.stops_hold)
    accounts = _Accounts()
    outputs = {}
    for call in ledger.calls:
        _account_call(call, ledger, accounts, outputs, problems)
    problems.extend(_paths_counted_once(plain, region, results, ledger, accounts, outputs))
    problems.extend(_recomputed_values_may_differ(ledger, region))
    problems.extend(_unfenced_reads(ledger))
    problems.extend(_unfenced_waits(ledger))
    if problems:
        unique = list(dict.fromkeys(problems))
        raise GradientMismatchError(
            "memsave: the rewritten backward pass would not compute tf.gradients' gradients "
            "(%d problem(s)): %s. This is a memsave bug: use tf.gradients for this graph and "
            "please report it." % (len(unique), "; ".join(unique[:8])))


def _differentiated_in_parts(op, differentiations, memos):
    """Problems of ``op`` differentiated in several segments (``differentiations``:
    ``[(call, image, arrived)]``), each on part of its output gradient, where
    that is not the sum of one differentiation: a user's gradient (need not
    be linear in it), or sparse rows (a row per lookup and segment)."""
    if len(differentiations) <= 1:
        return []
    segments = ", ".join(str(call.index) for call, _, _ in differentiations)
    users_memo, sparse_memo = memos
    if functions.runs_users_gradient(op, users_memo):
        return ["%s runs a gradient a user wrote, which need not be linear in its output "
                "gradient, in segments %s, each on part of it; tf.gradients runs it once"
                % (op.name, segments)]
    if functions.gives_sparse_rows(op, sparse_memo):
        return ["%s gives sparse gradient rows in segments %s, each on part of its output "
                "gradient: a row per lookup and segment, where tf.gradients gives one per "
                "lookup" % (op.name, segments)]
    return []


def _paths_counted_once(plain, region, results, ledger, accounts, outputs):
    """The problems with how the calls' arrivals add up (see the module docstring)."""
    problems = []
    live_in = collections.defaultdict(set)
    live_out = collections.defaultdict(list)    # tensor ref -> [(edge, consumer op)]
    for t, op, i in plain.edges:
        live_in[op].add(i)
        live_out[t.ref()].append(((op.name, i), op))
    for y, seeded in zip(region.ys, plain.seeded):
        if seeded:
            live_out[y.ref()].append(((_SEED, y.name), None))

    # Every differentiation of each original op, and arrivals that went nowhere.
    differentiations, stuck = collections.defaultdict(list), collections.defaultdict(list)
    for (call, image), arrived in accounts.consumed.items():
        original = ledger.original_op(image)
        if original is None or not arrived:
            continue
        (differentiations if image in call.sending else stuck)[original].append(
            (call, image, arrived))

    def expected(tensors):
        tokens = collections.Counter()
        for t in tensors:
            for edge, consumer in live_out.get(t.ref(), ()):
                if consumer is None:
                    tokens[(edge, None)] += 1
                for call, image, _ in differentiations.get(consumer, ()):
                    tokens[(edge, (call.index, image.name))] += 1
        return tokens - accounts.vanished

    memos = {}, {}
    x_refs = {x.ref() for x in region.xs}
    feeds_an_x = _feeding_an_x(plain, x_refs)
    for op in plain.sending:
        got = collections.Counter()
        problems.extend(_differentiated_in_parts(op, differentiations.get(op, ()), memos))
        for call, image, arrived in differentiations.get(op, ()):
            got.update(arrived)
            sent = accounts.inputs[(call, image)]
            problems.extend("the gradient along %s is dropped (segment %d)"
                            % (_edge_name(op, i), call.index)
                            for i in sorted(live_in[op] - sent)
                            if op.inputs[i].ref() in x_refs or feeds_an_x.get(op.inputs[i].op))
            problems.extend("gradient flows along %s, where tf.gradients sends none (segment %d)"
                            % (_edge_name(op, i), call.index)
                            for i in sorted(sent - live_in[op]) if plain.leads_to_an_x(op, i))
        problems.extend("the gradient reaching %s in segment %d goes no further"
                        % (op.name, call.index) for call, _, _ in stuck.get(op, ()))
        if feeds_an_x[op]:
            problems.extend(_compare(expected(op.outputs), got, op.name))

    for x, result in zip(region.xs, results):
        got = collections.Counter()
        for leaf in _terms(result, x, outputs, ledger, problems):
            got.update(accounts.carried.get(leaf, {}) if leaf[0] != _SEED
                       else {((_SEED, leaf[1]), None): 1})
        problems.extend(_compare(expected([x]), got, "the result for x " + x.name))
    return problems


def _feeding_an_x(plain, x_refs):
    """Per op plain backprop differentiates: whether what it sends can reach
    an x's result. Where not (it ends at the other outputs of a split that
    makes an x, which tf.gradients does not differentiate), a gradient
    dropped on the way changes no result: the rewrite may leave such an op
    out (under XLA a segment reads the split's pieces through a barrier, so
    its copies of them are not reached from the xs)."""
    into = collections.defaultdict(list)
    for t, op, _ in plain.edges:
        into[op].append(t)
    feeds = {}
    for op in sorted(plain.sending, key=tf_internal.op_id):   # inputs first
        feeds[op] = any(t.ref() in x_refs or feeds.get(t.op, False) for t in into[op])
    return feeds


def _compare(expected, got, where):
    out = []
    for token in sorted(set(expected) | set(got), key=repr):
        want, have = expected.get(token, 0), got.get(token, 0)
        if want == have:
            continue
        edge, sender = token
        if edge[0] == _SEED:
            what = "the seed of y %s" % edge[1]
        else:
            what = "the gradient arriving at %s from %s (input %d)%s" % (
                where, edge[0], edge[1],
                " as sent in segment %d" % sender[0] if sender is not None else "")
        if have == 0:
            out.append("%s is dropped" % what)
        elif want == 0:
            out.append("%s is counted where tf.gradients sends none" % what)
        else:
            out.append("%s is counted %d times" % (what, have))
    return out


def _account_call(call, ledger, accounts, outputs, problems):
    flow = _Flow(call.ys, call.xs, call.stops, call.start, ledger.stops_hold)
    call.sending = flow.sending
    targets = {x.ref(): x for x in call.xs}
    for x, g in zip(call.xs, call.outputs):
        accounts.carried[(call, x.ref())] = collections.Counter()
        if g is not None:
            # One tensor may be the gradient of several targets (an add's).
            t = g.values if isinstance(g, tf.IndexedSlices) else g
            outputs.setdefault(t.ref(), []).append((call, x.ref(), ledger.original_tensor(x)))

    def land(t, tokens):
        """Where gradient arriving at ``t`` ends: a target or an op's differentiation."""
        while True:
            if t.ref() in targets:
                accounts.carried[(call, t.ref())].update(tokens)
                if t.op in flow.sending:
                    # Collected, and differentiated further all the same (a
                    # function call is, even when it is a stop).
                    accounts.consumed[(call, t.op)].update(tokens)
                return
            if t.op in ledger.through and t.op in flow.sending:
                t = _passed_through(t)
                continue
            accounts.consumed[(call, t.op)].update(tokens)
            return

    for t, op, i in flow.edges:
        if op in ledger.through or _dead_end(t, ledger, flow, targets):
            continue
        original = ledger.original_op(op)
        if original is None:
            problems.append("segment %d differentiates %s, which is neither a copy "
                            "nor an original op" % (call.index, op.name))
            continue
        accounts.inputs[(call, op)].add(i)
        land(t, {((original.name, i), (call.index, op.name)): 1})
    for k, (y, seeded) in enumerate(zip(call.ys, flow.seeded)):
        if not seeded:
            continue
        g = call.grad_ys[k] if call.grad_ys is not None else None
        if g is None:
            original = ledger.original_tensor(y)
            name = original.name if original is not None else y.name
            land(y, {((_SEED, name), None): 1})
            continue
        arrived = collections.Counter()
        for leaf in _terms(g, ledger.original_tensor(y), outputs, ledger, problems):
            arrived.update(accounts.carried[leaf] if leaf[0] != _SEED
                           else {((_SEED, leaf[1]), None): 1})
        land(y, arrived)
    for x, g in zip(call.xs, call.outputs):
        if g is None:
            accounts.vanished.update(accounts.carried[(call, x.ref())])


def _dead_end(t, ledger, flow, targets):
    """Whether gradient sent to ``t`` stops there unused: an XLA barrier's
    output that the call neither asks for nor differentiates. The barrier
    also takes the gradients its segment waits for, so TensorFlow sees
    paths from the xs through it and differentiates towards its outputs;
    what arrives there is dropped (and XLA removes the dead computation).
    A live edge of plain backprop that ends here is reported as dropped."""
    return (t.op.type == "XlaOptimizationBarrier" and t.op in ledger.through
            and t.ref() not in targets and t.op not in flow.sending)


def _terms(g, owner, outputs, ledger, problems):
    """The gradient-call outputs (``(call, target ref)``) and seeds summed in
    ``g``, the gradient of the original tensor ``owner``."""
    if g is None:
        return []
    found, stack, used = [], [g], collections.Counter()
    while stack:
        t = stack.pop()
        if isinstance(t, tf.IndexedSlices):
            t = t.values
        if t.ref() in outputs:
            mine = [(call, ref) for call, ref, original in outputs[t.ref()]
                    if owner is not None and original is not None
                    and original.ref() == owner.ref()]
            if used[t.ref()] < len(mine):
                found.append(mine[used[t.ref()]])
            else:
                problems.append("the gradient sum of %s holds %s, a gradient of %s"
                                % (getattr(owner, "name", owner), t.name, "another tensor"
                                   if not mine else "it already summed"))
            used[t.ref()] += 1
        elif t.ref() in ledger.seeds:
            found.append((_SEED, ledger.seeds[t.ref()]))
        elif t.ref() in ledger.zeros:
            continue
        elif t.op in ledger.fences:
            stack.append(t.op.inputs[0])
        elif tf_internal.op_id(t.op) >= ledger.first_new and t.op.type in _SUM_TERMS:
            stack.extend(_SUM_TERMS[t.op.type](t.op))
        else:
            problems.append("a gradient sum holds %s, which no gradient call made" % t.name)
    return found


# ---------------------------------------------------------------------------
# Copies compute what their originals do.

def _fidelity(original, copy, ledger, body_path=""):
    where = body_path + original.name
    if copy.type != original.type:
        return ["the copy of %s is a %s, not a %s" % (where, copy.type, original.type)]
    out = []
    if copy.device != original.device:
        out.append("the copy of %s is placed on %r, not %r" % (where, copy.device,
                                                              original.device))
    if not tf_internal.same_gradient_function(original, copy):
        out.append("the copy of %s has another gradient function" % where)
    for i, (a, b) in enumerate(zip(original.inputs, copy.inputs)):
        mapped = ledger.original_tensor(b) if not body_path else a
        if mapped is None or mapped.ref() != a.ref():
            out.append("the copy of %s reads %s as input %d, not (a copy of) %s"
                       % (where, b.name, i, a.name))
    if functions.has_bodies(original):
        out.extend(_same_bodies(original, copy, ledger, where))
    return out


def _same_bodies(original, copy, ledger, where):
    out = []
    for py_attr in functions.body_attrs(original):
        source, new = getattr(original, py_attr, None), getattr(copy, py_attr, None)
        if new is None:
            out.append("the copy of %s has no %s: TensorFlow would rebuild it from the "
                       "function library for its gradient, without its captures"
                       % (where, py_attr))
            continue
        if source is None:
            continue   # rebuilt from the library by the copy; nothing to compare with
        old_ops = {op.name: op for op in source.get_operations()}
        new_ops = {op.name: op for op in new.get_operations()}
        if set(old_ops) != set(new_ops):
            out.append("the copy of %s has another %s" % (where, py_attr))
            continue
        for name, op in old_ops.items():
            if functions.has_bodies(op):
                out.extend(_fidelity(op, new_ops[name], ledger,
                                     body_path="%s/%s:" % (where, py_attr)))
        if len(new.captures) != len(source.captures):
            out.append("the copy of %s captures %d tensors in %s, its original %d"
                       % (where, len(new.captures), py_attr, len(source.captures)))
    return out


# ---------------------------------------------------------------------------
# Nothing recomputed may have changed.

def _has_effects(op):
    """Whether running ``op`` again may not do the same: a stateful op that is
    not known to be re-runnable (a write, a random draw, a print), or a call
    whose body holds one. Which ops are re-runnable is memsave's table
    (:mod:`memsave.graph.stateful`); when a write happens is derived here."""
    if op.type in stateful.FUNCTION_CALLS:
        return any(node is None or stateful.never_run_twice(node.op, node.attr)
                   or (node.op not in stateful.RECOMPUTABLE_STATEFUL and _is_stateful(node.op))
                   for node in stateful.body_nodes(op))
    if stateful.never_run_twice(op.type, op.node_def.attr):
        return True
    return op.type not in stateful.RECOMPUTABLE_STATEFUL and _is_stateful(op.type)


def _is_stateful(op_type):
    op_def = tf_internal.get_op_def(op_type)
    return op_def is None or op_def.is_stateful


def _recomputed_values_may_differ(ledger, region):
    out = []
    by_creation = tf_internal.orders_stateful_ops_by_creation(ledger.graph)
    downstream, facts = None, stateful.BufferFacts()
    for copy, original in ledger.copy_of.items():
        if _has_effects(original):
            out.append("%s (%s) is recomputed, but running it again may not give the same "
                       "result" % (original.name, original.type))
        if any(ledger.graph.is_feedable(t) for t in original.outputs) and not isinstance(
                ledger.graph, tf_internal.FuncGraph):
            out.append("%s (%s) is recomputed, but a Session may feed it: the copy would "
                       "not see the fed value" % (original.name, original.type))
        # A TF1 reference variable, written in place, is read through any
        # input that may share its buffer.
        reads = [(ref, stateful.ref_writers(ref)) for h in original.inputs
                 for ref in stateful.ref_variables(h, facts)]
        for h in original.inputs:
            if h.dtype != tf.resource or original.type in stateful.FORWARDS_HANDLE:
                continue   # an identity of a handle forwards it, reading nothing
            if not by_creation and original.type in stateful.FUNCTION_CALLS:
                out.append("%s (%s) reads %s in its body and is recomputed, in a graph "
                           "run by a Session: an update made after the gradients (an "
                           "optimizer's, in the same run) may write it first"
                           % (original.name, original.type, h.name))
                continue
            reads.append((h, [w for w in stateful.handle_users(h) if _has_effects(w)]))
        for h, writers in reads:
            for writer in writers:
                if writer in ledger.copy_of or writer is original:
                    continue
                if by_creation:
                    changed = (tf_internal.op_id(original) < tf_internal.op_id(writer)
                               < tf_internal.op_id(copy))
                else:
                    if downstream is None:
                        downstream = _downstream(region.ops, ledger.first_new)
                    changed = writer in downstream
                if changed:
                    out.append("%s is recomputed after %s may have written %s"
                               % (original.name, writer.name, h.name))
    return out


def _downstream(ops, limit):
    seen, stack = set(), list(ops)
    while stack:
        op = stack.pop()
        if op in seen or tf_internal.op_id(op) >= limit:
            continue
        seen.add(op)
        stack.extend(c for t in op.outputs for c in t.consumers())
        stack.extend(tf_internal.control_outputs(op))
    return seen


# ---------------------------------------------------------------------------
# Segments are fenced.

def _unfenced_reads(ledger):
    spans = ledger.spans
    if len(spans) < 2:
        return []
    out = []
    ops = [op for op in ledger.graph.get_operations()
           if tf_internal.op_id(op) >= spans[0] and op not in ledger.foreign]
    # A function's captures are its arguments, there from the start: a user's
    # gradient reading a value from outside that the forward pass never read
    # (a closed-over constant or variable) captures it in the segment that
    # runs it first, and a later segment's run reads the same capture.
    arguments = {internal.op for _, internal in getattr(ledger.graph, "captures", ())}

    def span(op):
        i = tf_internal.op_id(op)
        if i < spans[0] or op in arguments:
            return -1
        lo, hi = 0, len(spans) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if spans[mid] <= i:
                lo = mid
            else:
                hi = mid - 1
        return lo

    for op in ops:
        mine = span(op)
        for t in op.inputs:
            theirs = span(t.op)
            if 0 <= theirs < mine and t.op not in ledger.through:
                out.append("%s (segment %d) reads %s of segment %d without a fence"
                           % (op.name, mine, t.name, theirs))
    return out


# ---------------------------------------------------------------------------
# Waits are fenced.

def _unfenced_waits(ledger):
    """The ops memsave made itself (copies, joins, gates, swap-ins; not the
    ops of ``tf.gradients`` calls, whose control inputs TensorFlow sets)
    that wait for an op of the graph as it was, where their original does not."""
    calls = sorted((call.start, call.end) for call in ledger.calls)
    starts = [start for start, _ in calls]

    def in_a_call(i):
        k = bisect.bisect_right(starts, i) - 1
        return k >= 0 and i < calls[k][1]

    out = []
    for op in ledger.graph.get_operations()[::-1]:
        i = tf_internal.op_id(op)
        if i < ledger.first_new:
            break
        if in_a_call(i):
            continue
        original = ledger.copy_of.get(op)
        inherited = set(original.control_inputs) if original is not None else set()
        for c in op.control_inputs:
            if tf_internal.op_id(c) < ledger.first_new and c not in inherited:
                out.append("%s waits for %s, an op of the graph it rewrites, not for a fence"
                           % (op.name, c.name))
    return out
