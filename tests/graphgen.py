"""Random forward graphs described as plain data, for the property tests.

A :class:`Spec` is a small program over a pool of ``[B, W]`` float32
tensors. ``h0`` and ``h1`` are inputs; each op appends one tensor to the
pool (some ops build intermediate tensors on the way: a concat, split
pieces, a reduction, a transpose). Op operands are *back-offsets*: 0 is the
newest pool tensor, so shrinking turns any graph into a chain, and larger
offsets are residual and long skip edges. Variables (``w*`` matrices,
``b*`` biases, ``e*`` embedding tables) are fresh unless an op names an
earlier one, which shares it.

Everything is drawn by hypothesis as plain tuples and strings, then built
by :func:`build`, so a shrunk failure prints as a readable listing
(``repr(spec)``). The names of all float tensors a spec builds are known
without TensorFlow (:func:`tensor_names`), so checkpoints and xs are drawn
as names too.

With ``weak_spots=True`` (:func:`specs`), graphs also hold what memsave
finds hardest: while loops, ``map_fn``/``scan`` (TensorLists), loop bodies
that are stateful (dropout, ``tf.print``) or read a variable the step
writes afterwards (``Spec.writes``), ``tf.cond``, nested ``tf.function``
calls (some called twice), ``tf.custom_gradient``, ``Pow``/GELU (copies
read through a gate) and float32 conv + bias_add + relu (what oneDNN fuses).
"""

import contextlib
import dataclasses

import numpy as np
from hypothesis import strategies as st

B, W = 4, 6          # every pool tensor is [B, W]; W is even for reshape3
VOCAB = 7            # rows of an embedding table
UNARY = ("tanh", "relu", "sigmoid")
REDUCE = ("sum", "mean", "max")
LOSS_KINDS = ("sum_sq", "mean_tanh", "sum", "pair", "l2")


@dataclasses.dataclass(frozen=True)
class Spec:
    ops: tuple            # op tuples, see _OP_DOC
    losses: tuple         # ("sum_sq"|"mean_tanh"|"sum", a) | ("pair", a, b) | ("l2", var)
    outputs: tuple        # back-offsets of pool tensors that are ys themselves (non-scalar)
    sum_losses: bool      # one total loss instead of one y per loss
    grad_ys: tuple        # None, or one scale per y (0 means grad_ys entry None)
    xs: tuple             # names: variables, inputs h0/h1, pool tensors h<i>, "unused"
    checkpoints: tuple    # names from tensor_names(spec)
    writes: tuple = ()    # variables assigned after the forward pass, before gradients

    def __repr__(self):
        lines = ["Spec("]
        pool = 2
        for op in self.ops:
            lines.append("  h%d = %s" % (pool, _op_text(op, pool)))
            pool += 1
        lines.append("  losses=%r sum_losses=%r outputs=%r grad_ys=%r"
                     % (self.losses, self.sum_losses, self.outputs, self.grad_ys))
        lines.append("  xs=%r" % (self.xs,))
        lines.append("  checkpoints=%r" % (self.checkpoints,))
        if self.writes:
            lines.append("  writes=%r  (assigned after the forward pass)" % (self.writes,))
        lines.append("  # raw: ops=%r" % (self.ops,))
        lines.append(")")
        return "\n".join(lines)


_OP_DOC = """
("matmul", a, w)      h[a] @ w           (w: None = fresh variable, else index of an earlier w)
("unary", f, a)       f(h[a]), f in tanh/relu/sigmoid
("mul", a, b)         h[a] * h[b]
("add", a, b)         h[a] + h[b]
("bias", a, v)        h[a] + b_v          ([W] broadcast)
("rowadd", a, b)      h[a] + mean(h[b], axis=1, keepdims)   ([B,1] broadcast)
("concat_split", a, b, s)  c = concat(h[a], h[b]); p0,p1,p2 = split(c, [s, W, W-s]);
                      p1 + 0.5 * concat(p2, p0)
("reduce", f, axis, a)  h[a] - f(h[a], axis, keepdims)
("transpose", a)      reshape(transpose(h[a]), tf.shape(h[a]))   (int shape arithmetic)
("reshape3", a)       reshape(transpose(reshape(h[a], [B, W/2, 2]), [0, 2, 1]), [B, W])
("embed", e, seed)    gather(e, ids(seed))  (e: None = fresh table)
("dropout", a)        tf.nn.dropout(h[a], 0.5, noise_shape=Shape(h[a]))
("fracpool", a)       concat(fractional_avg_pool(h[a] as [1, B, W, 1], ratio 1.5 along W,
                      seed=0) as [B, W*2/3], h[a][:, :W/3]): declared stateless, yet
                      new windows at every run
("inplace", a)        h[a] * stop_gradient(InplaceAdd(DeepCopy(h[a]), rows 0 and 2, 0.5)):
                      declared stateless, yet it writes the copy's buffer
("loop", form, a, w)  a loop over h[a] reading w: form "while" (2 steps of
                      s/2 + tanh(s @ w)/2), "map" (tanh(row @ w) per row),
                      "scan" (acc/2 + tanh(row @ w)), "map_dropout" (dropout
                      in the body: stateful), "map_print" (tf.print in it)
("cond", a, w)        tf.cond(sum(h[a]) > 0, tanh(h[a] @ w), h[a] / 2)
("cond_gather", a, e, seed)  tf.cond(sum(h[a]) > 0, h[a] + gather(e, ids(seed)), h[a] / 2):
                      its gradient's rows come from one branch (XLA sizes them at run time)
("call", a, w, n)     a nested tf.function tanh(h @ w) * 1.5, applied n (1, 2) times
("custom", form, a)   tf.custom_gradient: form "silu" (tf.nn.silu), "tanh" (a
                      tanh whose gradient closes over its output)
("pow", form, a)      form "cube" (h[a] ** 3 / 3), "gelu" (approximate GELU)
("conv", a, k)        relu(bias_add(conv2d(h[a] as [B, W/2, 2, 1], k), k[0,0,0]))
                      in float32 (k: [2, 2, 1, 1])
"""

LOOP_FORMS = ("while", "map", "scan", "map_dropout", "map_print")


def _op_text(op, pool):
    kind = op[0]
    ref = lambda off: "h%d" % (pool - 1 - off)  # noqa: E731
    if kind == "matmul":
        return "matmul(%s, %s)" % (ref(op[1]), "fresh w" if op[2] is None else "w%d" % op[2])
    if kind == "unary":
        return "%s(%s)" % (op[1], ref(op[2]))
    if kind in ("mul", "add", "rowadd"):
        return "%s(%s, %s)" % (kind, ref(op[1]), ref(op[2]))
    if kind == "bias":
        return "%s + %s" % (ref(op[1]), "fresh b" if op[2] is None else "b%d" % op[2])
    if kind == "concat_split":
        return "concat_split(%s, %s, s=%d)" % (ref(op[1]), ref(op[2]), op[3])
    if kind == "reduce":
        return "%s - reduce_%s(%s, axis=%d)" % (ref(op[3]), op[1], ref(op[3]), op[2])
    if kind in ("transpose", "reshape3", "dropout", "fracpool", "inplace"):
        return "%s(%s)" % (kind, ref(op[1]))
    if kind == "embed":
        return "gather(%s, ids%d)" % ("fresh e" if op[1] is None else "e%d" % op[1], op[2])
    if kind == "loop":
        return "%s(%s, %s)" % (op[1], ref(op[2]), "fresh w" if op[3] is None else "w%d" % op[3])
    if kind == "cond":
        return "cond(%s, %s)" % (ref(op[1]), "fresh w" if op[2] is None else "w%d" % op[2])
    if kind == "cond_gather":
        return "cond_gather(%s, %s, ids%d)" % (ref(op[1]), "fresh e" if op[2] is None
                                               else "e%d" % op[2], op[3])
    if kind == "call":
        return "call%s(%s, %s)" % ("x%d" % op[3] if op[3] > 1 else "", ref(op[1]),
                                   "fresh w" if op[2] is None else "w%d" % op[2])
    if kind in ("custom", "pow"):
        return "%s_%s(%s)" % (kind, op[1], ref(op[2]))
    if kind == "conv":
        return "conv(%s, %s)" % (ref(op[1]), "fresh k" if op[2] is None else "k%d" % op[2])
    raise ValueError(kind)


# ---------------------------------------------------------------- names

def _walk(spec):
    """Yield (event, data) for the spec without TensorFlow: the single source
    of truth for variable and tensor names, used by both drawing and building."""
    counts = {"w": 0, "b": 0, "e": 0, "k": 0}
    pool = 2

    def var(prefix, index):
        if index is None or index >= counts[prefix]:
            name = "%s%d" % (prefix, counts[prefix])
            counts[prefix] += 1
            return name, True
        return "%s%d" % (prefix, index), False

    for op in spec_ops(spec):
        kind = op[0]
        h = "h%d" % pool
        inter = []
        new_var = None
        if kind in ("matmul", "cond", "call"):
            new_var = var("w", op[2])
        elif kind == "loop":
            new_var = var("w", op[3])
        elif kind == "conv":
            new_var = var("k", op[2])
            inter = [h + ".conv"]     # the convolution's output, before its bias
        elif kind == "bias":
            new_var = var("b", op[2])
        elif kind == "embed":
            new_var = var("e", op[1])
        elif kind == "cond_gather":
            new_var = var("e", op[2])
        elif kind == "concat_split":
            inter = [h + ".concat", h + ".p0", h + ".p1", h + ".p2", h + ".rest"]
        elif kind == "reduce":
            inter = [h + ".r"]
        elif kind == "rowadd":
            inter = [h + ".r"]
        elif kind == "transpose":
            inter = [h + ".t"]
        elif kind == "reshape3":
            inter = [h + ".r3", h + ".t3"]
        elif kind == "fracpool":
            inter = [h + ".pool"]
        yield "op", (op, pool, new_var, inter, h)
        pool += 1


def spec_ops(spec):
    return spec.ops if isinstance(spec, Spec) else spec


def variable_names(ops):
    names = []
    for _, (_, _, new_var, _, _) in _walk(ops):
        if new_var is not None and new_var[1]:
            names.append(new_var[0])
    return names


def tensor_names(ops, losses=()):
    """Names of every float tensor the forward pass builds, in build order."""
    names = ["h0", "h1"]
    for _, (_, _, _, inter, h) in _walk(ops):
        names.extend(inter)
        names.append(h)
    for i, _ in enumerate(losses):
        names.append("loss%d" % i)
    return names


# ---------------------------------------------------------------- drawing

# Where each op kind keeps its back-offset operands.
OPERANDS = {"matmul": (1,), "unary": (2,), "add": (1, 2), "mul": (1, 2), "rowadd": (1, 2),
            "bias": (1,), "concat_split": (1, 2), "reduce": (3,), "transpose": (1,),
            "reshape3": (1,), "dropout": (1,), "fracpool": (1,), "inplace": (1,), "embed": (), "loop": (2,), "cond": (1,), "cond_gather": (1,),
            "call": (1,), "custom": (2,), "pow": (2,), "conv": (1,)}
# Where ops that name a variable keep its share index, and its prefix.
SHARES = {"matmul": (2, "w"), "bias": (2, "b"), "embed": (1, "e"), "loop": (3, "w"),
          "cond": (2, "w"), "cond_gather": (2, "e"), "call": (2, "w"), "conv": (2, "k")}

_OFFSET = st.one_of(st.just(0), st.integers(0, 2), st.integers(0, 63))
_SHARE = st.one_of(st.none(), st.none(), st.integers(0, 3))


def _offset(pool_size):
    # Mostly the newest tensor (a chain); sometimes a residual or long skip.
    return _OFFSET.map(lambda off: off % pool_size)


def _weak_op():
    """One of the op kinds memsave finds hardest (see the module docstring)."""
    loop = st.tuples(st.just("loop"), st.sampled_from(LOOP_FORMS), _OFFSET, _SHARE)
    return st.one_of([
        loop, loop,
        st.tuples(st.just("cond"), _OFFSET, _SHARE),
        st.tuples(st.just("cond_gather"), _OFFSET, _SHARE, st.integers(0, 3)),
        st.tuples(st.just("call"), _OFFSET, _SHARE, st.integers(1, 2)),
        st.tuples(st.just("custom"), st.sampled_from(["silu", "tanh"]), _OFFSET),
        st.tuples(st.just("pow"), st.sampled_from(["cube", "gelu"]), _OFFSET),
        st.tuples(st.just("conv"), _OFFSET, _SHARE),
    ])


def _raw_op(allow_dropout, weak_spots=False):
    """One op with unnormalized operands (see :func:`_normalize`)."""
    kinds = [
        st.tuples(st.just("matmul"), _OFFSET, _SHARE),
        st.tuples(st.just("unary"), st.sampled_from(UNARY), _OFFSET),
        st.tuples(st.sampled_from(["add", "mul", "rowadd"]), _OFFSET, _OFFSET),
        st.tuples(st.just("bias"), _OFFSET, _SHARE),
        st.tuples(st.just("concat_split"), _OFFSET, _OFFSET, st.integers(1, W - 1)),
        st.tuples(st.just("reduce"), st.sampled_from(REDUCE), st.integers(0, 1), _OFFSET),
        st.tuples(st.sampled_from(["transpose", "reshape3"]), _OFFSET),
        st.tuples(st.just("embed"), _SHARE, st.integers(0, 3)),
    ]
    if allow_dropout:
        kinds.append(st.tuples(st.sampled_from(["dropout", "fracpool", "inplace"]), _OFFSET))
    plain = st.one_of(kinds)
    if not weak_spots:
        return plain
    # About one op in two is a weak spot (a loop one in eight).
    return st.one_of(plain, _weak_op())


def _normalize(raw_ops):
    """Clip back-offsets to the pool and make out-of-range shares fresh variables."""
    ops, counts = [], {"w": 0, "b": 0, "e": 0, "k": 0}
    for i, op in enumerate(raw_ops):
        pool = 2 + i
        kind = op[0]
        if kind in SHARES:
            share_at, prefix = SHARES[kind]
            share = op[share_at]
            if share is None or share >= counts[prefix]:
                share = None
                counts[prefix] += 1
            op = op[:share_at] + (share,) + op[share_at + 1:]
        positions = OPERANDS[kind]
        op = tuple(v % pool if k in positions else v for k, v in enumerate(op))
        ops.append(op)
    return tuple(ops)


def ancestry(ops, losses=()):
    """{name: set of names it depends on} for pool tensors, the tensors an op
    builds on the way (taken as depending on all of its operands) and
    variables (no TF)."""
    deps = {"h0": set(), "h1": set()}
    for _, (op, index, new_var, inter, h) in _walk(ops):
        kind = op[0]
        positions = OPERANDS[kind]
        mine = set()
        for k in positions:
            src = "h%d" % (index - 1 - op[k])
            mine |= {src} | deps[src]
        if new_var is not None:
            mine.add(new_var[0])
        for name in inter:
            deps[name] = set(mine)
        deps[h] = mine | set(inter)
    return deps


def _read_in_bodies(ops):
    """Variables that loops, conds and calls read (candidates for a later write)."""
    names = []
    for _, (op, _, new_var, _, _) in _walk(ops):
        if op[0] in ("loop", "cond", "cond_gather", "call") and new_var[0] not in names:
            names.append(new_var[0])
    return names


@st.composite
def specs(draw, min_ops=5, max_ops=60, allow_dropout=True, max_checkpoints=8,
          nested_xs=False, weak_spots=False):
    """A random Spec. Unless ``nested_xs``, no x is an ancestor of another x.
    ``weak_spots`` mixes in the op kinds memsave finds hardest."""
    ops = draw(st.lists(_raw_op(allow_dropout, weak_spots), min_size=min_ops,
                        max_size=max_ops).map(_normalize))
    n = len(ops)
    pool = 2 + n
    variables = variable_names(ops)

    # The newest tensor always feeds a loss; a few more losses and outputs.
    losses = [("sum_sq", 0)]
    for _ in range(draw(st.integers(0, 2))):
        kind = draw(st.sampled_from(LOSS_KINDS))
        if kind == "pair":
            losses.append(("pair", draw(_offset(pool)), draw(_offset(pool))))
        elif kind == "l2":
            if not variables:
                continue
            losses.append(("l2", draw(st.sampled_from(variables))))
        else:
            losses.append((kind, draw(_offset(pool))))
    outputs = tuple(draw(st.lists(_offset(pool), max_size=2, unique=True)))
    sum_losses = draw(st.booleans())
    n_ys = (1 if sum_losses else len(losses)) + len(outputs)
    grad_ys = draw(st.one_of(st.none(), st.tuples(*[st.sampled_from([1.0, 0.0, 0.5, -2.0])
                                                     for _ in range(n_ys)])))

    # xs: mostly variables, sometimes inputs, pool tensors (or a tensor an op
    # builds on the way: one piece of a split), or an unused variable.
    hidden = [name for name in tensor_names(ops) if name not in ("h0", "h1")]
    candidates = variables + ["h0", "h1", "unused"]
    xs = draw(st.lists(st.one_of(st.sampled_from(candidates), st.sampled_from(hidden)),
                       min_size=1, max_size=6, unique=True))
    if not nested_xs:
        deps = ancestry(ops)
        # Drop pool tensors that depend on another x (variables always stay).
        xs = [x for x in xs if not deps.get(x, set()) & set(xs)]
    xs = tuple(xs)

    names = tensor_names(ops, losses)
    checkpoints = tuple(draw(st.lists(st.sampled_from(names), max_size=max_checkpoints,
                                      unique=True)))
    readable = _read_in_bodies(ops)
    writes = tuple(draw(st.lists(st.sampled_from(readable), max_size=2, unique=True))
                   ) if readable else ()
    return Spec(ops, tuple(losses), outputs, sum_losses, grad_ys, xs, checkpoints, writes)


def has_nested_xs(spec):
    deps = ancestry(spec.ops)
    return any(x in deps.get(other, ()) for x in spec.xs for other in spec.xs)


# ---------------------------------------------------------------- building

def _init(name, shape):
    seed = sum(ord(c) * 131 ** i for i, c in enumerate(name)) % (2 ** 31)
    rng = np.random.RandomState(seed)
    scale = 1.0 / np.sqrt(shape[0]) if len(shape) == 2 else 0.5
    return (rng.randn(*shape) * scale).astype(np.float32)


def make_variables(tf, spec):
    """The spec's tf.Variables (and the unused one), by name."""
    shapes = {"w": (W, W), "b": (W,), "e": (VOCAB, W), "k": (2, 2, 1, 1)}
    out = {name: tf.Variable(_init(name, shapes[name[0]]), name=name)
           for name in variable_names(spec.ops)}
    out["unused"] = tf.Variable(_init("unused", (W, W)), name="unused")
    return out


def build(tf, spec, variables, watch=None, around=None):
    """Build the forward pass in the current graph (``watch``: called with the
    inputs ``[h0, h1]`` as soon as they exist, e.g. a tape's ``watch``;
    ``around``: called with each op's index in ``spec.ops``, a context
    manager to build it in, or None).

    Returns a dict: ``ys``, ``grad_ys`` (list or None), ``xs`` (tensors or
    variables), ``checkpoints`` (tensors), ``tensors`` (name -> tensor, every
    float tensor built) and ``forward`` (pool tensors and losses, to compare
    forward values).
    """
    rng = np.random.RandomState(0)
    named = {}
    pool = []

    def rec(name, t):
        named[name] = t
        return t

    pool.append(rec("h0", tf.constant(rng.randn(B, W).astype(np.float32), name="h0")))
    pool.append(rec("h1", tf.constant(rng.randn(B, W).astype(np.float32), name="h1")))
    if watch is not None:
        watch(list(pool))

    for _, (op, index, new_var, inter, h) in _walk(spec):
        kind = op[0]
        at = lambda off: pool[index - 1 - off]  # noqa: E731
        context = around(index - 2) if around is not None else None
        with tf.name_scope(h), context or contextlib.nullcontext():
            if kind == "matmul":
                out = tf.matmul(at(op[1]), variables[new_var[0]])
            elif kind == "unary":
                out = {"tanh": tf.tanh, "relu": tf.nn.relu, "sigmoid": tf.sigmoid}[op[1]](at(op[2]))
            elif kind == "add":
                out = at(op[1]) + at(op[2])
            elif kind == "mul":
                out = at(op[1]) * at(op[2])
            elif kind == "bias":
                out = at(op[1]) + variables[new_var[0]]
            elif kind == "rowadd":
                r = rec(inter[0], tf.reduce_mean(at(op[2]), axis=1, keepdims=True))
                out = at(op[1]) + r
            elif kind == "concat_split":
                c = rec(inter[0], tf.concat([at(op[1]), at(op[2])], axis=1))
                s = op[3]
                p0, p1, p2 = tf.split(c, [s, W, W - s], axis=1)
                rec(inter[1], p0)
                rec(inter[2], p1)
                rec(inter[3], p2)
                rest = rec(inter[4], tf.concat([p2, p0], axis=1))
                out = p1 + 0.5 * rest
            elif kind == "reduce":
                f = {"sum": tf.reduce_sum, "mean": tf.reduce_mean, "max": tf.reduce_max}[op[1]]
                a = at(op[3])
                r = rec(inter[0], f(a, axis=op[2], keepdims=True))
                out = a - r
            elif kind == "transpose":
                a = at(op[1])
                t = rec(inter[0], tf.transpose(a))
                out = tf.reshape(t, tf.shape(a))
            elif kind == "reshape3":
                r3 = rec(inter[0], tf.reshape(at(op[1]), [B, W // 2, 2]))
                t3 = rec(inter[1], tf.transpose(r3, [0, 2, 1]))
                out = tf.reshape(t3, [B, W])
            elif kind == "embed":
                ids = np.random.RandomState(op[2]).randint(0, VOCAB, size=B).astype(np.int32)
                out = tf.gather(variables[new_var[0]], tf.constant(ids))
            elif kind == "dropout":
                a = at(op[1])
                out = tf.nn.dropout(a, rate=0.5, noise_shape=tf.raw_ops.Shape(input=a))
            elif kind == "fracpool":
                a = at(op[1])
                pooled = tf.nn.fractional_avg_pool(tf.reshape(a, [1, B, W, 1]),
                                                   [1.0, 1.0, 1.5, 1.0], pseudo_random=True)[0]
                pooled = rec(inter[0], tf.reshape(pooled, [B, W * 2 // 3]))
                out = tf.concat([pooled, a[:, :W // 3]], axis=1)
            elif kind == "inplace":
                a = at(op[1])
                added = tf.raw_ops.InplaceAdd(x=tf.raw_ops.DeepCopy(x=a), i=[0, 2],
                                              v=tf.fill([2, W], tf.constant(0.5, a.dtype)))
                out = a * tf.stop_gradient(added)
            elif kind == "loop":
                out = _loop(tf, op[1], at(op[2]), variables[new_var[0]])
            elif kind == "cond":
                a, w = at(op[1]), variables[new_var[0]]
                out = tf.cond(tf.reduce_sum(a) > 0, lambda: tf.tanh(a @ w), lambda: a * 0.5)
            elif kind == "cond_gather":
                a, e = at(op[1]), variables[new_var[0]]
                ids = np.random.RandomState(op[3]).randint(0, VOCAB, size=B).astype(np.int32)
                out = tf.cond(tf.reduce_sum(a) > 0, lambda: a + tf.gather(e, tf.constant(ids)),
                              lambda: a * 0.5)
            elif kind == "call":
                out = at(op[1])
                for _ in range(op[3]):
                    out = _function(tf, "call")(out, variables[new_var[0]])
            elif kind == "custom":
                out = (tf.nn.silu(at(op[2])) if op[1] == "silu"
                       else _function(tf, "custom_tanh")(at(op[2])))
            elif kind == "pow":
                a = at(op[2])
                out = a ** 3 / 3.0 if op[1] == "cube" else tf.nn.gelu(a, approximate=True)
            elif kind == "conv":
                k = variables[new_var[0]]
                image = tf.reshape(at(op[1]), [B, W // 2, 2, 1])
                conv = rec(inter[0], tf.nn.conv2d(image, k, 1, "SAME"))
                out = tf.reshape(tf.nn.relu(tf.nn.bias_add(conv, tf.reshape(k[0, 0, 0], [1]))),
                                 [B, W])
            else:
                raise AssertionError(kind)
        pool.append(rec(h, out))

    n = len(pool)
    loss_ts = []
    for i, loss in enumerate(spec.losses):
        kind = loss[0]
        with tf.name_scope("loss%d" % i):
            if kind == "sum_sq":
                t = tf.reduce_sum(tf.square(pool[n - 1 - loss[1]]))
            elif kind == "mean_tanh":
                t = tf.reduce_mean(tf.tanh(pool[n - 1 - loss[1]]))
            elif kind == "sum":
                t = tf.reduce_sum(pool[n - 1 - loss[1]])
            elif kind == "pair":
                t = tf.reduce_sum(pool[n - 1 - loss[1]] * pool[n - 1 - loss[2]])
            elif kind == "l2":
                v = variables[loss[1]]
                t = 0.01 * tf.reduce_sum(v * v)
            else:
                raise AssertionError(kind)
        loss_ts.append(rec("loss%d" % i, t))

    if spec.sum_losses:
        ys = [tf.add_n(loss_ts, name="total_loss") if len(loss_ts) > 1 else loss_ts[0]]
    else:
        ys = list(loss_ts)
    ys += [pool[n - 1 - off] for off in spec.outputs]

    grad_ys = None
    if spec.grad_ys is not None:
        grad_ys = []
        for k, (y, scale) in enumerate(zip(ys, spec.grad_ys)):
            if scale == 0.0:
                grad_ys.append(None)
            else:
                shape = y.shape.as_list()
                value = np.random.RandomState(k).uniform(0.5, 1.5, size=shape) * scale
                grad_ys.append(tf.constant(value.astype(np.float32)))

    expected = tensor_names(spec.ops, spec.losses)
    assert list(named) == expected, (list(named), expected)

    # Writes after the forward pass: in a tf.function they run after it
    # (automatic control dependencies); in a Graph they wait for all of it.
    writes = []
    with tf.control_dependencies([t.op for t in ys + pool + loss_ts]):
        for name in spec.writes:
            writes.append(variables[name].assign_add(
                tf.fill(variables[name].shape, 0.25), read_value=False))

    xs = []
    for name in spec.xs:
        xs.append(variables[name] if name in variables else named[name])
    return dict(ys=ys, grad_ys=grad_ys, xs=xs,
                checkpoints=[named[c] for c in spec.checkpoints],
                tensors=named, forward=pool + loss_ts, writes=writes)


def without_xla_kernels(spec):
    """Whether the forward pass holds an op XLA cannot compile: tf.print in a
    loop body, a fractional pool, a DeepCopy."""
    return any((op[0] == "loop" and op[1] == "map_print") or op[0] in ("fracpool", "inplace")
               for op in spec.ops)


def is_random(spec):
    """Whether the forward pass draws random numbers (forward values differ per run)."""
    return any(op[0] in ("dropout", "fracpool") or (op[0] == "loop" and op[1] == "map_dropout")
               for op in spec.ops)


def _loop(tf, form, h, w):
    if form == "while":
        # The static bound lets XLA compile it (its gradient's TensorLists).
        return tf.while_loop(lambda i, s: i < 2,
                             lambda i, s: (i + 1, 0.5 * s + 0.5 * tf.tanh(s @ w)),
                             [tf.constant(0), h], maximum_iterations=2)[1]

    def row(r):
        return tf.tanh(tf.linalg.matvec(w, r, transpose_a=True))

    if form == "map":
        return tf.map_fn(row, h)
    if form == "scan":
        return tf.scan(lambda acc, r: 0.5 * acc + row(r), h)
    if form == "map_dropout":
        return tf.map_fn(lambda r: tf.nn.dropout(row(r), 0.5), h)
    if form == "map_print":
        def body(r):
            tf.print(tf.reduce_sum(r), output_stream="file:///dev/null")
            return row(r)
        return tf.map_fn(body, h)
    raise AssertionError(form)


_FUNCTIONS = {}


def _function(tf, name):
    """Functions made once per process: a nested tf.function and a custom gradient."""
    if name not in _FUNCTIONS:
        if name == "call":
            _FUNCTIONS[name] = tf.function(lambda h, w: tf.tanh(h @ w) * 1.5)
        else:
            @tf.custom_gradient
            def custom_tanh(x):
                y = tf.tanh(x)

                def grad(dy):
                    return dy * (1.0 - y * y)   # closes over the forward output
                return y, grad
            _FUNCTIONS[name] = custom_tanh
    return _FUNCTIONS[name]
