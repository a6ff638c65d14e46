"""Reversible and invertible blocks: activation memory that does not grow with depth.

Checkpointing (the rest of memsave) still keeps O(sqrt(n)) activations of an
n-layer net. A block whose input can be computed back from its output needs
none: the backward pass walks the blocks from the last to the first,
*reconstructs* each block's input from its output with ``inverse``, recomputes
the block's forward from that input under a local ``tf.GradientTape`` and
backpropagates through that one block. Only the final output of a run of
invertible blocks is kept from the forward pass, and only one block's
activations are alive at a time in the backward pass, so peak memory is O(1)
in depth (RevNets, Gomez et al. 2017; the same trick serves normalizing
flows, whose blocks are invertible anyway).

Contract (:class:`InvertibleBlock`): ``forward(x) -> y``, ``inverse(y) -> x``,
``log_det(x)`` (a per-example vector of shape ``[batch]``: the log of
``|det dy/dx|`` for one example, summed over every non-batch position; zeros
for volume-preserving blocks), ``forward_and_log_det(x)`` (both at once;
override it when they share work) and ``trainable_variables``. Channels are
the last axis; the first axis is the batch.

Ready-made blocks: :class:`ReversibleResidual` (RevNet),
:class:`AdditiveCoupling` (NICE), :class:`AffineCoupling` (RealNVP/Glow, with
a bounded scale), :class:`ActNorm` and :class:`Invertible1x1Conv` (Glow). The
functions ``f``/``g`` of the couplings may be Keras 3 layers or models (TF
backend) or plain callables; pass the variables a plain callable reads as
``variables=`` so that ``trainable_variables`` lists them (gradients reach
them either way).

:class:`ReversibleSequence` chains blocks: ``y, log_det = seq(x)``. Entries
that are not :class:`InvertibleBlock` (a stem ``Dense``, a pooling function)
run normally, and their activations are stored as usual; each run of
consecutive invertible blocks between them is one ``tf.custom_gradient``
function whose forward keeps only its output. The per-example total
log-determinant is an output of that function as well, and its upstream
gradient is folded into each block's recomputation (the recomputed block
is differentiated with ``output_gradients=[dy, dlog_det]``), so a loss
using it gets the gradients of the plain computation, up to the round-off
of the reconstruction.

Drift: floating-point inverses are not exact, and an ill-conditioned block
(a tiny scale, a near-singular matrix) reconstructs a wrong input, which
silently corrupts the gradients of every block below it. With
``check_inverse=True`` the forward pass also computes
``inverse(forward(x))`` for every block (on every ``check_every``-th call)
and measures ``max|x - inverse(forward(x))| / max(1, max|x|)``. The check is
made of TensorFlow ops, so it runs inside ``tf.function`` without retracing;
a block above ``tolerance`` is named in a WARNING of the ``memsave`` logger
(once per block; through ``tf.py_function`` in graphs, which a SavedModel
cannot carry to another process). With ``store_drifted=True`` a block
that has drifted once (a sticky per-block flag held in a non-trainable
variable) keeps its input from then on, chosen with ``tf.cond`` at run time:
the store holds an empty tensor for healthy blocks, so memory stays O(1)
until something drifts, and gradients are exact from the call that detected
the drift on. ``seq.drift`` reports the largest error seen per block.

Requirements on the blocks: their forward must be deterministic and free of
side effects (it runs twice: no dropout, no batch statistics updates), and
``inverse`` must not need anything but the output and the variables.
Gradients reach a run's input and the trainable variables its blocks read,
not tensors ``f`` closes over. Higher-order gradients through a reversible
run raise a ValueError where they reach a reconstructed input.

With :func:`memsave.gradients` (checkpointing of the non-invertible parts)
the results are the same as ``tf.gradients``; list the sequence's outputs
among the checkpoints (or use ``'optimal'``), otherwise the rewrite may copy
and recompute the run's forward once more, which costs time, not memory.
"""

import logging
import numbers

import numpy as np
import tensorflow as tf

from memsave import tf_internal

logger = logging.getLogger("memsave")

__all__ = [
    "ActNorm", "AdditiveCoupling", "AffineCoupling", "Invertible1x1Conv",
    "InvertibleBlock", "ReversibleResidual", "ReversibleSequence",
]

# --------------------------------------------------------------------------
# helpers


def _dedup(variables):
    seen, out = set(), []
    for v in variables:
        if id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out


def _check_callable(fn, what, owner):
    if not callable(fn):
        raise TypeError("memsave.reversible: %s needs a callable %s (a Keras layer or a "
                        "function of a tensor), got %r" % (owner, what, fn))


def _check_variables(variables, owner):
    if variables is None:
        return []
    if not isinstance(variables, (list, tuple)):
        variables = [variables]
    for v in variables:
        if not (isinstance(v, tf.Variable) or hasattr(v, "assign")):
            raise TypeError("memsave.reversible: %s variables= must hold tf.Variable objects, "
                            "got %r" % (owner, v))
    return list(variables)


def _channels(x, owner):
    """The static size of the last axis of ``x`` (raises a clear error)."""
    if x.shape.rank is not None and x.shape.rank < 2:
        raise ValueError("memsave.reversible: %s needs inputs of shape [batch, ..., channels], "
                         "got shape %s" % (owner, x.shape))
    c = x.shape[-1] if x.shape.rank is not None else None
    if c is None:
        raise ValueError("memsave.reversible: %s needs a statically known channel (last) axis, "
                         "got shape %s" % (owner, x.shape))
    return int(c)


def _check_output(out, channels, owner, what):
    if not isinstance(out, (tf.Tensor, tf.Variable)) and not hasattr(out, "shape"):
        raise TypeError("memsave.reversible: %s: %s must return one tensor, got %r"
                        % (owner, what, type(out).__name__))
    out = tf.convert_to_tensor(out)
    c = out.shape[-1] if out.shape.rank else None
    if c is not None and int(c) != channels:
        raise ValueError("memsave.reversible: %s: %s must return %d channels on the last axis, "
                         "got shape %s" % (owner, what, channels, out.shape))
    return out


def _batch_ones(x):
    return tf.ones(tf.shape(x)[:1], dtype=x.dtype)


def _spatial(x):
    """Number of positions per example and channel (product of the middle axes)."""
    return tf.cast(tf.reduce_prod(tf.shape(x)[1:-1]), x.dtype)


def _sum_per_example(t):
    return tf.reduce_sum(t, axis=tf.range(1, tf.rank(t)))


# --------------------------------------------------------------------------
# blocks


class InvertibleBlock(tf.Module):
    """Base class of the invertible blocks :class:`ReversibleSequence` reverses.

    Subclasses implement ``forward(x)`` and ``inverse(y)``; ``log_det(x)``
    defaults to zeros (volume preserving). ``log_det`` returns a vector of
    shape ``[batch]``: per example, the log of the absolute Jacobian
    determinant summed over all non-batch positions. ``trainable_variables``
    lists the ``tf.Variable`` attributes (through ``tf.Module``) plus the
    trainable variables of any function in :meth:`functions` (Keras layers)
    and the ``variables=`` given to the block.
    """

    def __init__(self, name=None, variables=None):
        super().__init__(name=name)
        self._extra_variables = _check_variables(variables, type(self).__name__)

    def forward(self, x):
        raise NotImplementedError("%s must implement forward(x)" % type(self).__name__)

    def inverse(self, y):
        raise NotImplementedError("%s must implement inverse(y)" % type(self).__name__)

    def log_det(self, x):
        """Per-example log|det J| (shape ``[batch]``); zero by default."""
        return tf.zeros(tf.shape(x)[:1], dtype=x.dtype)

    def forward_and_log_det(self, x):
        """``(forward(x), log_det(x))``; override when the two share work."""
        return self.forward(x), self.log_det(x)

    def functions(self):
        """The callables (e.g. Keras layers) whose variables this block owns."""
        return ()

    @property
    def trainable_variables(self):
        out = list(super().trainable_variables)
        for fn in self.functions():
            out.extend(getattr(fn, "trainable_variables", None) or ())
        out.extend(v for v in self._extra_variables if getattr(v, "trainable", True))
        return _dedup(out)

    def __call__(self, x):
        return self.forward(x)

    def __repr__(self):
        return "<%s %r>" % (type(self).__name__, self.name)


class _Split:
    """Split the last axis into a conditioning half and a transformed half."""

    def __init__(self, x, swap, owner):
        c = _channels(x, owner)
        if c < 2:
            raise ValueError("memsave.reversible: %s needs at least 2 channels, got %d"
                             % (owner, c))
        first = c // 2
        self.sizes = (first, c - first)
        a, b = tf.split(x, list(self.sizes), axis=-1)
        self.swap = swap
        # (conditioning part, transformed part)
        self.cond, self.moved = (b, a) if swap else (a, b)

    @property
    def moved_channels(self):
        return self.sizes[0] if self.swap else self.sizes[1]

    def join(self, cond, moved):
        return tf.concat([moved, cond] if self.swap else [cond, moved], axis=-1)


class ReversibleResidual(InvertibleBlock):
    """RevNet block: ``y1 = x1 + f(x2)``, ``y2 = x2 + g(y1)``.

    ``x`` is split on the last axis into ``x1`` (the first ``c // 2``
    channels) and ``x2`` (the rest); ``f`` maps ``x2``'s channels to
    ``x1``'s, ``g`` the other way. Inverse: ``x2 = y2 - g(y1)``,
    ``x1 = y1 - f(x2)``. Volume preserving (log-det 0).
    """

    def __init__(self, f, g, *, variables=None, name=None):
        owner = "ReversibleResidual"
        _check_callable(f, "f", owner)
        _check_callable(g, "g", owner)
        super().__init__(name=name, variables=variables)
        self.f, self.g = f, g

    def functions(self):
        return (self.f, self.g)

    def _halves(self, t):
        c = _channels(t, repr(self))
        return tf.split(t, [c // 2, c - c // 2], axis=-1)

    def forward(self, x):
        x1, x2 = self._halves(x)
        y1 = x1 + _check_output(self.f(x2), x1.shape[-1], repr(self), "f")
        y2 = x2 + _check_output(self.g(y1), x2.shape[-1], repr(self), "g")
        return tf.concat([y1, y2], axis=-1)

    def inverse(self, y):
        y1, y2 = self._halves(y)
        x2 = y2 - _check_output(self.g(y1), y2.shape[-1], repr(self), "g")
        x1 = y1 - _check_output(self.f(x2), y1.shape[-1], repr(self), "f")
        return tf.concat([x1, x2], axis=-1)


class AdditiveCoupling(InvertibleBlock):
    """NICE coupling: one half passes through, the other gets ``+ f(that half)``.

    By default the first ``c // 2`` channels condition and the rest move;
    ``swap=True`` exchanges the roles (alternate it when stacking). ``f``
    must return as many channels as the moving half. Log-det 0.
    """

    def __init__(self, f, *, swap=False, variables=None, name=None):
        _check_callable(f, "f", "AdditiveCoupling")
        super().__init__(name=name, variables=variables)
        self.f, self.swap = f, bool(swap)

    def functions(self):
        return (self.f,)

    def forward(self, x):
        s = _Split(x, self.swap, repr(self))
        shift = _check_output(self.f(s.cond), s.moved_channels, repr(self), "f")
        return s.join(s.cond, s.moved + shift)

    def inverse(self, y):
        s = _Split(y, self.swap, repr(self))
        shift = _check_output(self.f(s.cond), s.moved_channels, repr(self), "f")
        return s.join(s.cond, s.moved - shift)


class AffineCoupling(InvertibleBlock):
    """Affine coupling: ``y_b = x_b * scale + shift`` with ``(raw, shift) = f(x_a)``.

    ``f`` returns ``2 * m`` channels for a moving half of ``m`` channels; the
    first ``m`` are ``raw``, the rest ``shift``. The scale is
    ``sigmoid(raw + 2) + eps``: in ``(eps, 1 + eps)``, about 0.88 at
    ``raw = 0``, so neither it nor ``log(scale)`` nor their gradients can
    overflow or produce NaN. ``log_det = sum log(scale)`` per example.
    """

    def __init__(self, f, *, swap=False, eps=1e-6, variables=None, name=None):
        _check_callable(f, "f", "AffineCoupling")
        if not isinstance(eps, numbers.Real) or not eps > 0:
            raise ValueError("memsave.reversible: AffineCoupling eps must be a positive number, "
                             "got %r" % (eps,))
        super().__init__(name=name, variables=variables)
        self.f, self.swap, self.eps = f, bool(swap), float(eps)

    def functions(self):
        return (self.f,)

    def _scale_shift(self, s):
        m = s.moved_channels
        h = _check_output(self.f(s.cond), 2 * m, repr(self),
                          "f (log-scale and shift for %d moving channels)" % m)
        raw, shift = tf.split(h, 2, axis=-1)
        scale = tf.sigmoid(raw + 2.0) + tf.cast(self.eps, h.dtype)
        return scale, shift

    def forward_and_log_det(self, x):
        s = _Split(x, self.swap, repr(self))
        scale, shift = self._scale_shift(s)
        y = s.join(s.cond, s.moved * scale + shift)
        return y, _sum_per_example(tf.math.log(scale))

    def forward(self, x):
        return self.forward_and_log_det(x)[0]

    def log_det(self, x):
        return self.forward_and_log_det(x)[1]

    def inverse(self, y):
        s = _Split(y, self.swap, repr(self))
        scale, shift = self._scale_shift(s)
        return s.join(s.cond, (s.moved - shift) / scale)


def _check_channels(channels, owner):
    if isinstance(channels, bool) or not isinstance(channels, numbers.Integral) or channels < 1:
        raise ValueError("memsave.reversible: %s needs a positive integer number of channels, "
                         "got %r" % (owner, channels))
    return int(channels)


class _FixedChannels(InvertibleBlock):
    """A block built for a given number of channels (``self.channels``)."""

    def _check(self, x):
        c = _channels(x, repr(self))
        if c != self.channels:
            raise ValueError("memsave.reversible: %r expects %d channels, got shape %s"
                             % (self, self.channels, x.shape))


class ActNorm(_FixedChannels):
    """Per-channel affine map ``y = x * scale + bias`` (Glow's actnorm).

    ``log_det = spatial * sum(log|scale|)`` per example, where ``spatial``
    is the number of positions per channel (1 for ``[batch, channels]``).
    ``scale_init``/``bias_init`` are scalars or per-channel vectors (no
    data-dependent initialisation: set them from data yourself if wanted).
    """

    def __init__(self, channels, *, scale_init=1.0, bias_init=0.0, dtype=tf.float32, name=None):
        channels = _check_channels(channels, "ActNorm")
        super().__init__(name=name)
        self.channels = channels
        try:
            scale = np.broadcast_to(np.asarray(scale_init, dtype=np.float64), (channels,))
            bias = np.broadcast_to(np.asarray(bias_init, dtype=np.float64), (channels,))
        except ValueError:
            raise ValueError("memsave.reversible: ActNorm scale_init and bias_init must be "
                             "scalars or %d values" % channels) from None
        if np.any(scale == 0):
            raise ValueError("memsave.reversible: ActNorm scale_init must be non-zero "
                             "(the block would not be invertible)")
        self.scale = tf.Variable(scale.astype(tf.as_dtype(dtype).as_numpy_dtype), name="scale")
        self.bias = tf.Variable(bias.astype(tf.as_dtype(dtype).as_numpy_dtype), name="bias")

    def forward(self, x):
        self._check(x)
        return x * self.scale + self.bias

    def inverse(self, y):
        self._check(y)
        return (y - self.bias) / self.scale

    def log_det(self, x):
        self._check(x)
        total = tf.reduce_sum(tf.math.log(tf.abs(self.scale)))
        return _batch_ones(x) * (_spatial(x) * total)


class Invertible1x1Conv(_FixedChannels):
    """A learned ``channels x channels`` matrix ``W`` applied on the channel axis.

    ``y[..., d] = sum_c x[..., c] W[c, d]`` (Glow's invertible 1x1
    convolution, for any number of spatial axes). ``W`` starts as a random
    orthogonal matrix (QR of a Gaussian draw; ``seed`` or TensorFlow's
    global seed) unless ``weight`` gives it. The inverse uses
    ``tf.linalg.inv(W)``; ``log_det = spatial * log|det W|`` via
    ``tf.linalg.slogdet``.
    """

    def __init__(self, channels, *, weight=None, seed=None, dtype=tf.float32, name=None):
        channels = _check_channels(channels, "Invertible1x1Conv")
        super().__init__(name=name)
        self.channels = channels
        np_dtype = tf.as_dtype(dtype).as_numpy_dtype
        if weight is None:
            q, r = tf.linalg.qr(tf.random.normal([channels, channels], seed=seed,
                                                 dtype=tf.float64))
            q = q * tf.sign(tf.linalg.diag_part(r))[tf.newaxis, :]
            value = q.numpy().astype(np_dtype)
        else:
            value = np.asarray(weight, dtype=np_dtype)
            if value.shape != (channels, channels):
                raise ValueError("memsave.reversible: Invertible1x1Conv weight must have shape "
                                 "(%d, %d), got %s" % (channels, channels, value.shape))
        self.weight = tf.Variable(value, name="weight")

    def forward(self, x):
        self._check(x)
        return tf.einsum("...c,cd->...d", x, self.weight)

    def inverse(self, y):
        self._check(y)
        return tf.einsum("...c,cd->...d", y, tf.linalg.inv(self.weight))

    def log_det(self, x):
        self._check(x)
        _, logabs = tf.linalg.slogdet(self.weight)
        return _batch_ones(x) * (_spatial(x) * logabs)


# --------------------------------------------------------------------------
# the sequence


def _block_forward(block, x):
    """``block.forward_and_log_det(x)`` with its results checked."""
    out = block.forward_and_log_det(x)
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise TypeError("memsave.reversible: %r.forward_and_log_det must return (y, log_det), "
                        "got %r" % (block, type(out).__name__))
    y, ld = tf.convert_to_tensor(out[0]), tf.convert_to_tensor(out[1])
    if y.dtype != x.dtype or (y.shape.rank is not None and x.shape.rank is not None
                              and y.shape.rank != x.shape.rank):
        raise ValueError("memsave.reversible: %r maps %s %s to %s %s; an invertible block keeps "
                         "the rank and dtype" % (block, x.dtype.name, x.shape, y.dtype.name,
                                                   y.shape))
    if ld.shape.rank is not None and ld.shape.rank != 1:
        raise ValueError("memsave.reversible: %r.log_det must return a per-example vector of "
                         "shape [batch], got shape %s" % (block, ld.shape))
    return y, tf.cast(ld, y.dtype)


@tf.custom_gradient
def _reconstructed(x):
    """``x``, a block input the backward pass computed back from its output.

    To first order it is a leaf of the block's recomputation (watched there).
    A higher-order gradient would need how it depends on the blocks below
    it, which the reconstruction does not carry (with a stop, a gradient
    penalty through two RevNet blocks was 26% off, silently): it raises.
    """
    def refused(_):
        raise ValueError(
            "memsave.reversible: a higher-order gradient (e.g. a gradient penalty) reached a "
            "block input that the backward pass reconstructed; reversible runs support "
            "first-order gradients only: call the sequence with store_activations=True for "
            "higher-order ones")
    return tf.identity(x), refused


class _Run:
    """Consecutive invertible blocks (``indices`` into the sequence's block list)."""

    def __init__(self):
        self.blocks, self.indices = [], []


class ReversibleSequence(tf.Module):
    """Blocks applied in order; ``y, log_det = seq(x)``.

    ``blocks``: a non-empty list of :class:`InvertibleBlock` objects and
    other callables (Keras layers, functions of one tensor). Consecutive
    invertible blocks form a run that keeps no activations (see the module
    docstring); the other callables run normally. ``log_det`` is the
    per-example total (shape ``[batch]``) of the invertible blocks;
    non-invertible entries contribute nothing to it.

    ``check_inverse``: measure each invertible block's reconstruction error
    in the forward pass (every ``check_every``-th call, counted in a
    variable so it works inside ``tf.function``) and log a WARNING naming
    blocks above ``tolerance`` (the error is
    ``max|x - inverse(forward(x))| / max(1, max|x|)``). ``store_drifted=True``
    (needs ``check_inverse``) makes such blocks keep their input from the
    detecting call on, so gradients stay exact. ``seq(x,
    store_activations=True)`` runs the ordinary forward (everything stored,
    plain autodiff), for comparisons.
    """

    def __init__(self, blocks, *, check_inverse=False, tolerance=1e-4, store_drifted=False,
                 check_every=1, name=None):
        super().__init__(name=name)
        if isinstance(blocks, (InvertibleBlock, str, bytes)) or not isinstance(blocks,
                                                                               (list, tuple)):
            raise TypeError("memsave.reversible: ReversibleSequence needs a list of blocks, got "
                            "%r" % (blocks,))
        if not blocks:
            raise ValueError("memsave.reversible: ReversibleSequence needs at least one block")
        for i, b in enumerate(blocks):
            if not isinstance(b, InvertibleBlock) and (not callable(b) or isinstance(b, type)):
                raise TypeError(
                    "memsave.reversible: block %d is %r, which is neither an InvertibleBlock "
                    "nor a callable layer/function" % (i, b))
        if not isinstance(check_inverse, bool):
            raise TypeError("memsave.reversible: check_inverse must be True or False, got %r"
                            % (check_inverse,))
        if (isinstance(tolerance, bool) or not isinstance(tolerance, numbers.Real)
                or not tolerance > 0):
            raise ValueError("memsave.reversible: tolerance must be a positive number, got %r"
                             % (tolerance,))
        if not isinstance(store_drifted, bool):
            raise TypeError("memsave.reversible: store_drifted must be True or False, got %r"
                            % (store_drifted,))
        if store_drifted and not check_inverse:
            raise ValueError("memsave.reversible: store_drifted=True acts on blocks found to "
                             "drift, so it needs check_inverse=True")
        if (isinstance(check_every, bool) or not isinstance(check_every, numbers.Integral)
                or check_every < 1):
            raise ValueError("memsave.reversible: check_every must be a positive integer, got %r"
                             % (check_every,))
        self._layers = list(blocks)
        self.check_inverse = check_inverse
        self.tolerance = float(tolerance)
        self.store_drifted = store_drifted
        self.check_every = int(check_every)
        self._segments = []        # _Run objects and plain callables, in order
        self._invertible = []      # the InvertibleBlocks, in order
        self._positions = []       # their positions in ``blocks``
        for position, b in enumerate(blocks):
            if isinstance(b, InvertibleBlock):
                self._positions.append(position)
                if not self._segments or not isinstance(self._segments[-1], _Run):
                    self._segments.append(_Run())
                self._segments[-1].blocks.append(b)
                self._segments[-1].indices.append(len(self._invertible))
                self._invertible.append(b)
            else:
                self._segments.append(b)
        self._warned = set()
        self._drift = None
        self._calls = None
        if check_inverse and self._invertible:
            with tf.init_scope():
                self._drift = tf.Variable(tf.zeros([len(self._invertible)], tf.float32),
                                          trainable=False, name="drift")
                if self.check_every > 1:
                    self._calls = tf.Variable(0, dtype=tf.int64, trainable=False, name="calls")

    # -- introspection -------------------------------------------------------

    @property
    def blocks(self):
        return list(self._layers)

    @property
    def trainable_variables(self):
        out = []
        for b in self._layers:
            out.extend(getattr(b, "trainable_variables", None) or ())
        return _dedup(out)

    @property
    def drift(self):
        """``{block index: largest reconstruction error seen}`` (with ``check_inverse``)."""
        if self._drift is None:
            return {}
        values = self._drift.numpy()
        return {p: float(v) for p, v in zip(self._positions, values)}

    def _label(self, index):
        b = self._invertible[index]
        return "block %d (%s %r)" % (self._positions[index], type(b).__name__, b.name)

    # -- forward -------------------------------------------------------------

    # The blocks are plain TensorFlow ops; AutoGraph conversion would only
    # slow tracing down (and warn about the lambdas below).
    @tf.autograph.experimental.do_not_convert
    def __call__(self, x, *, store_activations=False):
        x = tf.convert_to_tensor(x)
        if not x.dtype.is_floating:
            raise TypeError("memsave.reversible: ReversibleSequence needs a floating-point "
                            "input, got %s" % x.dtype.name)
        if x.shape.rank is not None and x.shape.rank < 2:
            raise ValueError("memsave.reversible: ReversibleSequence needs inputs of shape "
                             "[batch, ..., channels], got shape %s" % x.shape)
        do_check = None
        if self.check_inverse and not store_activations and self._calls is not None:
            n = self._calls.assign_add(1)
            do_check = tf.equal((n - 1) % self.check_every, 0)
        h, total = x, None
        for seg in self._segments:
            if isinstance(seg, _Run):
                if store_activations:
                    for b in seg.blocks:
                        h, ld = _block_forward(b, h)
                        total = ld if total is None else total + ld
                    continue
                h, ld = self._reversible_run(seg, h, do_check)
                total = ld if total is None else total + ld
            else:
                h = seg(h)
                if not isinstance(h, (tf.Tensor, tf.Variable)) and not hasattr(h, "dtype"):
                    raise TypeError("memsave.reversible: non-invertible block %r must return "
                                    "one tensor, got %r" % (seg, type(h).__name__))
                h = tf.convert_to_tensor(h)
        if total is None:
            total = tf.zeros(tf.shape(h)[:1], dtype=h.dtype)
        return h, total

    @tf.autograph.experimental.do_not_convert
    def inverse(self, y):
        """Run every block's inverse, last to first (all blocks must be invertible)."""
        plain = [b for b in self._layers if not isinstance(b, InvertibleBlock)]
        if plain:
            raise TypeError("memsave.reversible: inverse() needs every block to be an "
                            "InvertibleBlock; %r is not" % (plain[0],))
        x = tf.convert_to_tensor(y)
        for b in reversed(self._layers):
            x = b.inverse(x)
        return x

    # -- drift checks --------------------------------------------------------

    def _warn(self, index, err):
        if err <= self.tolerance:    # False for NaN, which is reported
            return
        if index in self._warned:
            logger.debug("memsave.reversible: %s drifted again (error %.3g)",
                         self._label(index), err)
            return
        self._warned.add(index)
        action = ("its input is stored from now on (store_drifted=True), so gradients stay exact"
                  if self.store_drifted else
                  "gradients below it are approximate; pass store_drifted=True to store its "
                  "input instead")
        logger.warning("memsave.reversible: %s reconstructs its input with relative error "
                       "%.3g > tolerance %.3g: %s", self._label(index), err, self.tolerance,
                       action)

    def _report(self, index, err):
        """Warn (from Python, or from a ``tf.py_function`` in a graph) above tolerance."""
        if tf.executing_eagerly():
            self._warn(index, float(err.numpy()))
            return None

        def report(e):
            self._warn(index, float(e.numpy()))
            return np.float32(0)
        return tf.py_function(report, [err], tf.float32, name="memsave_drift_report")

    @staticmethod
    def _error(x, y, block):
        x_hat = block.inverse(y)
        x32, d = tf.cast(x, tf.float32), tf.cast(x - x_hat, tf.float32)
        err = tf.reduce_max(tf.abs(d)) / tf.maximum(1.0, tf.reduce_max(tf.abs(x32)))
        return tf.where(tf.math.is_finite(err), err, tf.constant(np.inf, tf.float32))

    def _check(self, block, x, y, do_check):
        if do_check is None:
            return self._error(x, y, block)
        return tf.cond(do_check, lambda: self._error(x, y, block), lambda: tf.constant(0.0))

    # -- the reversible run ----------------------------------------------------

    def _reversible_run(self, run, x, do_check):
        checking = self.check_inverse
        store = self.store_drifted

        @tf.custom_gradient
        def reversible_run(x):
            # Nothing inside is recorded on any tape: the gradient below
            # recomputes what it needs, so no tape may keep these tensors.
            with tf_internal.stop_recording():
                h, total = x, None
                errors, saved, flags = [], [], []
                if checking:
                    seen = tf.gather(self._drift, run.indices)
                for j, block in enumerate(run.blocks):
                    y, ld = _block_forward(block, h)
                    if checking:
                        err = self._check(block, h, y, do_check)
                        done = [err, self._report(run.indices[j], err)]
                        errors.append(err)
                        if store:
                            hit = tf.logical_or(seen[j] > self.tolerance,
                                                tf.logical_not(err <= self.tolerance))
                            empty = tf.zeros([0], h.dtype)
                            kept = tf.cond(hit, lambda h=h: tf.reshape(h, [-1]),
                                           lambda e=empty: e)
                            flags.append(hit)
                            saved.append((kept, tf.shape(h), h.shape))
                            done.append(kept)
                        # The next block starts once this one is checked (and
                        # stored or not): otherwise a graph may run the whole
                        # forward first and keep every input alive for its check.
                        with tf.control_dependencies([d for d in done if d is not None]):
                            y = tf.identity(y)
                    total = ld if total is None else total + ld
                    h = y
                if checking:
                    self._drift.scatter_max(tf.IndexedSlices(tf.stack(errors),
                                                             tf.constant(run.indices)))
            return (h, total), self._grad_fn(run, h, saved, flags)

        return reversible_run(x)

    @staticmethod
    def _grad_fn(run, y_out, saved, flags):
        """The backward pass of one run; it holds only the run's output (and stores)."""
        blocks = list(run.blocks)

        def grad_fn(dy, dld, variables=None):
            y = y_out
            if dy is None:
                dy = tf.zeros_like(y)
            if dld is None:
                dld = tf.zeros(tf.shape(y)[:1], y.dtype)
            grads = {}
            wait = []
            for j in reversed(range(len(blocks))):
                block = blocks[j]
                # Reconstruct this block's input only once the block after it
                # is fully differentiated, so one block's activations are alive
                # at a time even when the runtime could run ahead.
                with tf.control_dependencies(wait):
                    if saved:
                        kept, dyn_shape, static_shape = saved[j]
                        x = tf.cond(flags[j],
                                    lambda k=kept, s=dyn_shape: tf.reshape(k, s),
                                    lambda b=block, t=y: b.inverse(t))
                        x.set_shape(static_shape)
                    else:
                        x = block.inverse(y)
                    x = _reconstructed(x)
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    y_j, ld_j = _block_forward(block, x)
                watched = list(tape.watched_variables())
                out = tape.gradient([y_j, ld_j], [x] + watched, output_gradients=[dy, dld])
                dx = out[0] if out[0] is not None else tf.zeros_like(x)
                for v, g in zip(watched, out[1:]):
                    if g is None:
                        continue
                    prev = grads.get(v.ref())
                    grads[v.ref()] = g if prev is None else (
                        tf.convert_to_tensor(prev) + tf.convert_to_tensor(g))
                wait = [dx] + [g for g in out[1:] if g is not None]
                dy, y = dx, x
                del tape, y_j, ld_j, out
            if variables is None:
                return dy
            return dy, [grads.get(v.ref()) for v in variables]

        return grad_fn
