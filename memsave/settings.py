"""memsave's options: one table, checked and resolved once, where the user passes them.

Every entry point (:func:`memsave.gradients`, :func:`memsave.plan`,
:class:`memsave.GradientTape`, :func:`memsave.patch`,
:func:`memsave.patching.scope`, :func:`memsave.keras.enable`,
:func:`memsave.profile.estimate_peak`) takes ``checkpoints=`` and the
keywords of :data:`PARAMETERS`, and hands them to :func:`resolve` at once.
The rest of memsave reads only the frozen :class:`Settings` it returns, so
a misspelled keyword or a bad value is an error at the user's call, before
any graph work, and no later layer interprets an option again.

No TensorFlow here: tensors listed in ``checkpoints=`` or ``offload=`` are
checked against the graph when a plan is made.
"""

import dataclasses
import difflib
import numbers
import re
import warnings

from memsave.planning import registry
from memsave.planning.offload import OffloadModel
from memsave.planning.strategies import MAX_RECOMPUTE_ERROR

COLLECTION = "collection"   # checkpoints= the graph's 'checkpoints' collection

# The strategy of tapes, patch() and Keras: 'optimal' was as good as or
# better than the others on every model measured (memsave.gradients keeps
# 'collection' for parity with the original library).
DEFAULT_CHECKPOINTS = "optimal"

# The keywords every entry point takes, in the order docs/api.md lists them.
PARAMETERS = ("checkpoints", "budget", "max_recompute", "offload", "fallback",
              "min_checkpoint_size", "shapes", "batch_size", "verify", "xla", "offload_model")

# Keywords that became fields of OffloadModel.
_OFFLOAD_MODEL_FIELDS = ("swapin_ahead", "swapin_groupby", "host_device", "host_bandwidth",
                         "device_flops")

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMGT]i?B|B)?\s*$", re.I)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


@dataclasses.dataclass(frozen=True)
class Checkpoints:
    """``checkpoints=`` resolved: a strategy over the planning graph, or tensors to keep.

    ``strategy`` is None for tensors: ``tensors`` lists them, or is None for
    the graph's 'checkpoints' collection. ``by_name``: a name was given
    ('optimal', 'collection', a registered one), a request to save memory,
    so plain gradients may be used where the plan would not (see
    ``fallback``); a list or a callable is the user's own choice and always
    honoured.
    """

    given: object
    label: str
    strategy: object = None
    tensors: tuple = None
    by_name: bool = False

    @property
    def from_collection(self):
        return self.strategy is None and self.tensors is None


@dataclasses.dataclass(frozen=True)
class Settings:
    """Every memsave option, checked (see :data:`PARAMETERS` and docs/api.md)."""

    checkpoints: Checkpoints
    budget: float = None           # bytes, or a fraction of plain's peak when < 1
    max_recompute: float = None    # fraction of a training step's work
    offload: object = None         # None, 'auto' or a tuple of tensors
    fallback: bool = True
    min_checkpoint_size: int = 1024
    shapes: dict = None
    batch_size: int = None
    verify: object = None          # None/False, True or a tolerance
    xla: bool = None               # None: tell from the trace
    offload_model: OffloadModel = OffloadModel()

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    @property
    def bounds_time(self):
        """Whether the caller bounds the step's time: a ``max_recompute`` cap or
        the 'speed' strategy (see :func:`memsave.graph.region.pinned_on_cpu`)."""
        return self.max_recompute is not None or self.checkpoints.label == "speed"

    def strategy_options(self):
        """The options a planning-graph strategy may take (see memsave.planning.registry)."""
        return dict(budget=self.budget, max_recompute=self.max_recompute,
                    min_checkpoint_size=self.min_checkpoint_size,
                    offload="auto" if self.offload == "auto" else None,
                    model=self.offload_model)


def strategy_names():
    """Every name ``checkpoints=`` accepts: built-ins, 'collection', registered ones."""
    names = registry.strategy_names()
    return names[:len(registry.BUILT_IN)] + [COLLECTION] + names[len(registry.BUILT_IN):]


def resolve(checkpoints, options, where, extra=()):
    """The :class:`Settings` of one call of ``where`` (e.g. 'memsave.patch').

    ``options`` are the call's keywords besides ``checkpoints``; ``extra``
    names further keywords the caller takes itself (it must remove them
    first). Raises TypeError naming an unknown keyword, ValueError or
    TypeError for a bad value.
    """
    options = dict(options)
    if "strategy" in options:
        warnings.warn("%s: strategy= is now called checkpoints=" % where, DeprecationWarning,
                      stacklevel=3)
        checkpoints = options.pop("strategy")
    _check_names(options, where, extra)
    chosen = resolve_checkpoints(checkpoints)
    settings = Settings(
        checkpoints=chosen,
        budget=_budget(options.get("budget")),
        max_recompute=_max_recompute(options.get("max_recompute")),
        offload=_offload(options.get("offload")),
        fallback=_flag("fallback", options.get("fallback", True)),
        min_checkpoint_size=_count("min_checkpoint_size", options.get("min_checkpoint_size",
                                                                      1024), 0),
        shapes=_shapes(options.get("shapes")),
        batch_size=_count("batch_size", options.get("batch_size"), 1),
        verify=_verify(options.get("verify")),
        xla=_xla(options.get("xla")),
        offload_model=_offload_model(options.get("offload_model")))
    _check_strategy_takes(chosen, settings)
    return settings


def _check_names(options, where, extra):
    for name in options:
        if name in PARAMETERS or name in extra:
            continue
        if name in _OFFLOAD_MODEL_FIELDS:
            raise TypeError("%s() got an unexpected keyword argument %r: it is a field of "
                            "memsave.OffloadModel; pass offload_model=memsave.OffloadModel("
                            "%s=...)" % (where, name, name))
        close = difflib.get_close_matches(name, PARAMETERS + tuple(extra), n=1)
        raise TypeError("%s() got an unexpected keyword argument %r%s" % (
            where, name, " (did you mean %r?)" % close[0] if close else ""))


def resolve_checkpoints(checkpoints):
    """``checkpoints=`` as a :class:`Checkpoints`, or a clear error."""
    if isinstance(checkpoints, str):
        if checkpoints == COLLECTION:
            return Checkpoints(checkpoints, COLLECTION, by_name=True)
        strategy = registry.lookup(checkpoints)
        if strategy is None:
            raise ValueError("unknown checkpoints strategy %r; use one of %s, a callable "
                             "strategy or a list of tensors" % (
                                 checkpoints, ", ".join(map(repr, strategy_names()))))
        return Checkpoints(checkpoints, checkpoints, strategy, by_name=True)
    if callable(checkpoints):
        return Checkpoints(checkpoints, registry.label(checkpoints), checkpoints)
    if isinstance(checkpoints, (list, tuple)):
        return Checkpoints(checkpoints, "list", tensors=tuple(checkpoints))
    raise TypeError("checkpoints must be a strategy name (%s), a callable strategy or a "
                    "list of tensors, got %r" % (", ".join(strategy_names()), checkpoints))


def _check_strategy_takes(chosen, settings):
    given = dict(budget=settings.budget, max_recompute=settings.max_recompute)
    if chosen.strategy is not None:
        registry.check_options(chosen.strategy, repr(chosen.label), given)
        return
    for option, value in given.items():
        if value is not None:
            raise ValueError("%s= needs checkpoints='optimal' or a strategy that accepts it; "
                             "got %s" % (option, "a list of tensors" if chosen.tensors
                                         is not None else repr(chosen.given)))


def parse_bytes(text):
    """``"6GiB"``, ``"800MB"``, ``"1.5e9"`` as a number of bytes (GiB = 2**30, GB = 10**9)."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError("budget %r is not a size; write bytes (6442450944), a size such as "
                         "'6GiB' or '800MB', or a fraction of plain's peak (0.5)" % (text,))
    return float(match.group(1)) * _UNITS[(match.group(2) or "B").lower()]


def _number(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _budget(value):
    if value is None:
        return None
    if isinstance(value, str):
        value = parse_bytes(value)
        if value < 1:
            raise ValueError("budget of %r bytes: a size is at least one byte" % (value,))
    if not _number(value):
        raise TypeError("budget must be a number (bytes, or a fraction of the plain peak "
                        "below 1) or a size such as '6GiB'; got %r" % (value,))
    if not 0 < value < float("inf"):   # NaN too
        raise ValueError("budget must be > 0 and finite: bytes, a size such as '6GiB', or a "
                         "fraction of the plain peak below 1; got %r" % (value,))
    return value


def _max_recompute(value):
    if value is not None and (not _number(value) or not value >= 0):   # NaN too
        raise ValueError(MAX_RECOMPUTE_ERROR % (value,))
    return value


def _offload(value):
    if value is None or value == "auto":
        return value
    if isinstance(value, str):
        raise ValueError("offload must be None, 'auto' or a list of tensors, got %r" % (value,))
    if not isinstance(value, (list, tuple)):
        raise TypeError("offload must be None, 'auto' or a list of tensors, got %r" % (value,))
    return tuple(value)


def _flag(name, value):
    if not isinstance(value, bool):
        raise TypeError("%s must be True or False, got %r" % (name, value))
    return value


def _count(name, value, least):
    if value is None and least > 0:
        return None
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < least:
        raise ValueError("%s must be an int >= %d, got %r" % (name, least, value))
    return int(value)


def _shapes(value):
    if value is None:
        return None
    if not hasattr(value, "items"):
        raise TypeError("shapes must be a dict {input tensor or name: shape}, got %r" % (value,))
    return dict(value.items())


def _verify(value):
    if value is None or isinstance(value, bool):
        return value
    if not _number(value) or not value > 0:
        raise ValueError("verify must be True, False or a tolerance > 0 (relative to the "
                         "largest gradient entry), got %r" % (value,))
    return float(value)


def _xla(value):
    if value is not None and not isinstance(value, bool):
        raise TypeError("xla must be None (tell from the trace), True or False, got %r"
                        % (value,))
    return value


def _offload_model(value):
    if value is None:
        return OffloadModel()
    if not isinstance(value, OffloadModel):
        raise TypeError("offload_model must be a memsave.OffloadModel, got %r" % (value,))
    return value
