"""Strategies as data: any callable over a planning graph, found by name or passed in.

A strategy is a callable ``strategy(graph, **options)`` that takes a
:class:`~memsave.planning.dag.PlanGraph` and returns either a
:class:`~memsave.planning.plan.Plan` or an iterable of tensor names to keep
(memsave then estimates it with :func:`~memsave.planning.strategies.plan_for`).
The built-ins ('optimal', 'memory', 'speed') are registered instances of
exactly that, so a user's function goes wherever a name goes
(``memsave.gradients``, ``memsave.GradientTape``, ``memsave.keras.enable``,
``memsave.patch``).

Options of ``memsave.gradients`` (``budget``, ``max_recompute``,
``min_checkpoint_size``, ``offload``, ``model``) reach a strategy when its
signature names them (or takes ``**options``); ``budget`` or
``max_recompute`` given to a strategy that cannot take them is an error
rather than silently ignored. A strategy that does not take ``offload``
gets every kept tensor offloaded under ``offload='auto'``.
"""

import inspect
import logging
import threading

from memsave.errors import StrategyError
from memsave.planning.dag import validate
from memsave.planning.optimal import optimal
from memsave.planning.plan import Plan
from memsave.planning.strategies import memory, plan_for, speed, with_offload

logger = logging.getLogger("memsave")

# Options that change what a plan is; a strategy that cannot honour them must not
# be handed them silently.
STRICT_OPTIONS = ("budget", "max_recompute")

_lock = threading.Lock()
_registry = {"optimal": optimal, "memory": memory, "speed": speed}
BUILT_IN = frozenset(_registry)


def register_strategy(name, strategy, replace=False):
    """Make ``checkpoints=name`` run ``strategy`` (see the module docstring).

    Built-in names cannot be replaced; another registered name only with
    ``replace=True``. Returns ``strategy``, so it works as a decorator
    factory's body: ``register_strategy("convs", keep_op_types("Conv2D"))``.
    """
    if not isinstance(name, str) or not name:
        raise TypeError("a strategy name must be a non-empty str, got %r" % (name,))
    if not callable(strategy):
        raise TypeError("strategy must be callable as strategy(graph, **options), got %r"
                        % (strategy,))
    with _lock:
        if name in BUILT_IN or (name in _registry and not replace):
            raise ValueError("strategy %r is already registered%s" % (
                name, " (built-in)" if name in BUILT_IN else "; pass replace=True"))
        _registry[name] = strategy
    return strategy


def unregister_strategy(name):
    """Forget a strategy registered with :func:`register_strategy`."""
    with _lock:
        if name in BUILT_IN:
            raise ValueError("built-in strategy %r cannot be unregistered" % (name,))
        _registry.pop(name, None)


def strategy_names():
    """Registered names, built-ins first."""
    with _lock:
        return sorted(_registry, key=lambda n: (n not in BUILT_IN, n))


def lookup(name):
    """The strategy registered as ``name``, or None."""
    with _lock:
        return _registry.get(name)


def label(strategy):
    """How plans and logs name ``strategy``: its registered name, else its own name.

    The policies of :mod:`memsave.planning.policies` set ``strategy_name``;
    a ``functools.partial`` is named after its function.
    """
    with _lock:
        for name, registered in _registry.items():
            if registered is strategy:
                return name
    named = getattr(strategy, "func", strategy)
    return (getattr(strategy, "strategy_name", None) or getattr(named, "__name__", None)
            or type(strategy).__name__)


def accepts(strategy, option):
    """Whether ``strategy``'s signature takes keyword ``option``."""
    try:
        params = inspect.signature(strategy).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is p.VAR_KEYWORD or (p.name == option and p.kind in (
        p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)) for p in params)


def check_options(strategy, what, options):
    """Raise if ``options`` holds a strict option ``strategy`` cannot take."""
    for option in STRICT_OPTIONS:
        if options.get(option) is not None and not accepts(strategy, option):
            raise ValueError(
                "%s= needs checkpoints='optimal' or a strategy that accepts %s=; got %s"
                % (option, option, what))


def run(strategy, graph, **options):
    """Run ``strategy`` on ``graph``; always a :class:`Plan` whose names are in ``graph``.

    ``options`` with value None are not passed; the others are passed when
    the strategy's signature takes them (see the module docstring). With
    ``offload='auto'`` and a strategy that does not take ``offload``, every
    kept tensor that can wait on the host does.
    """
    plan = _run(strategy, graph, options)
    if options.get("offload") == "auto" and not accepts(strategy, "offload"):
        plan = with_offload(graph, plan, None, options.get("model"))
    return plan


def _run(strategy, graph, options):
    validate(graph)
    name = label(strategy)
    check_options(strategy, repr(name), options)
    given = {k: v for k, v in options.items() if v is not None and accepts(strategy, k)}
    result = strategy(graph, **given)
    if isinstance(result, Plan):
        names = list(result.checkpoints) + list(result.offloaded)
        _check_names(graph, name, names)
        result.strategy = name
        return result
    if result is None or isinstance(result, (str, bytes)) or not _iterable(result):
        raise StrategyError(
            "strategy %s returned %r; return a memsave.Plan or an iterable of tensor names "
            "(an empty list keeps nothing: plain backprop)" % (name, result))
    names = list(result)
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise StrategyError("strategy %s returned %r among its names; names are str (tensor "
                            "names such as 'dense/Relu:0')" % (name, bad[0]))
    _check_names(graph, name, names)
    keep = [n for n in names if not graph.nodes[n]["x"] and not graph.nodes[n]["y"]]
    return plan_for(graph, keep, name)


def _iterable(value):
    try:
        iter(value)
    except TypeError:
        return False
    return True


def _check_names(graph, name, names):
    unknown = [n for n in names if n not in graph]
    if unknown:
        raise StrategyError(
            "strategy %s returned %d name(s) that are not tensors between xs and ys: %s"
            % (name, len(unknown), ", ".join(map(str, unknown[:5]))))
