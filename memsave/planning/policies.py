"""Small strategies that compose, in the spirit of JAX's checkpoint policies.

Each function here returns a strategy (see :mod:`memsave.planning.registry`):

* :func:`keep_expensive` keeps the outputs of ops with many FLOPs per byte
  (matmuls, convolutions, einsums: JAX's ``dots_saveable``), from the
  planning graph's ``expensive`` flag;
* :func:`keep_op_types` keeps the outputs of the named op types
  (``keep_op_types("MatMul", "BatchMatMulV2")``);
* :func:`keep_names` keeps the named tensors (``save_only_these_names``);
* :func:`never_keep` and :func:`always_keep` constrain another strategy,
  'optimal' by default, which plans the rest (budget included);
* :func:`combine` keeps what any of several strategies keeps.

A *selector* names tensors: a string matches a tensor name
(``"block1/conv/Conv2D:0"``), an op name (``"block1/conv/Conv2D"``) or an
op type (``"Softmax"``); :func:`matching` selects tensor names by a regular
expression; a callable ``select(name, node)`` gets the tensor name and its
node, the very record strategies read (``node["op_type"]`` or
``node.op_type``).
"""

import logging
import re

from memsave.planning import registry
from memsave.planning.dag import topological
from memsave.planning.simulate import plain_peak
from memsave.planning.strategies import plan_for, with_offload

logger = logging.getLogger("memsave")


def _matcher(selectors, what):
    if not selectors:
        raise ValueError("%s needs at least one selector (a name, an op type or a callable)"
                         % what)
    strings, calls = set(), []
    for s in selectors:
        if isinstance(s, str) and s:
            strings.add(s)
        elif callable(s):
            calls.append(s)
        else:
            raise TypeError("%s: a selector is a non-empty str or a callable(name, node), "
                            "got %r" % (what, s))

    def match(graph, name):
        data = graph.nodes[name]
        if name in strings or name.rpartition(":")[0] in strings or data["op_type"] in strings:
            return True
        return any(c(name, data) for c in calls)

    return match, strings


def _describe(selectors):
    return ", ".join(s if isinstance(s, str) else getattr(s, "__name__", "callable")
                     for s in selectors)


def _named(fn, name):
    fn.strategy_name = name
    fn.__name__ = name
    return fn


def _resolve(then):
    if isinstance(then, str):
        strategy = registry.lookup(then)
        if strategy is None:
            raise ValueError("unknown checkpoints strategy %r; use one of %s"
                             % (then, ", ".join(map(repr, registry.strategy_names()))))
        return strategy
    if callable(then):
        return then
    raise TypeError("then= must be a strategy name or a callable strategy, got %r" % (then,))


def matching(pattern):
    """A selector of the tensors whose name matches the regular expression ``pattern``
    (``re.search``: ``matching(r"attention.*/Softmax")``)."""
    try:
        compiled = re.compile(pattern)
    except (TypeError, re.error) as e:
        raise ValueError("matching needs a regular expression, got %r (%s)" % (pattern, e)) \
            from None

    def select(name, node):
        del node
        return compiled.search(name) is not None

    select.__name__ = "matching(%r)" % pattern
    return select


def keep_expensive(graph):
    """A strategy: keep the outputs of expensive ops (matmuls, convolutions), nothing else.

    The choice comes from the planning graph's ``expensive`` flag (many
    FLOPs per byte), not from op names. Everything between those outputs is
    recomputed, by every segment that needs it ('speed' also keeps what
    several segments would each recompute).
    """
    return [n for n, d in graph.nodes(data=True) if d["candidate"] and d["expensive"]]


def keep_op_types(*op_types):
    """Keep the outputs of ops of these types (``"Conv2D"``, ``"MatMul"``), nothing else."""
    for t in op_types:
        if not isinstance(t, str) or not t:
            raise TypeError("op types are non-empty str, got %r" % (t,))
    if not op_types:
        raise ValueError("keep_op_types needs at least one op type")
    wanted = frozenset(op_types)

    def strategy(graph):
        return [n for n, d in graph.nodes(data=True) if d["candidate"] and d["op_type"] in wanted]

    return _named(strategy, "keep_op_types(%s)" % ", ".join(sorted(wanted)))


def keep_names(*selectors):
    """Keep exactly the selected tensors (those that may be kept)."""
    match, strings = _matcher(selectors, "keep_names")

    def strategy(graph):
        chosen = [n for n, d in graph.nodes(data=True) if d["candidate"] and match(graph, n)]
        found = {n for n in graph if match(graph, n)}
        missing = [s for s in strings if not any(
            s in (n, n.rpartition(":")[0], graph.nodes[n]["op_type"]) for n in found)]
        if missing:
            logger.warning("memsave: keep_names: no tensor between xs and ys is called %s",
                           ", ".join(sorted(missing)))
        return chosen

    return _named(strategy, "keep_names(%s)" % _describe(selectors))


def never_keep(*selectors, then="optimal"):
    """``then`` (a name or a strategy), choosing among all tensors but the selected ones."""
    match, _ = _matcher(selectors, "never_keep")
    inner = then

    def strategy(graph, **options):
        g = graph.copy()
        for n in g:
            if g.nodes[n]["candidate"] and match(g, n):
                g.nodes[n]["candidate"] = False
        plan = registry.run(_resolve(inner), g, **options)
        plan.strategy = strategy.strategy_name
        return plan

    return _named(strategy, "never_keep(%s) then %s" % (_describe(selectors), _label(then)))


def always_keep(*selectors, then="optimal"):
    """``then`` (a name or a strategy), with the selected tensors kept whatever it chooses.

    The planner knows they are kept, so it plans the rest around them.
    """
    match, _ = _matcher(selectors, "always_keep")
    inner = then

    def strategy(graph, **options):
        g = graph.copy()
        pinned = []
        for n in g:
            d = g.nodes[n]
            if d["candidate"] and match(g, n):
                d["candidate"], d["forced"] = False, True
                pinned.append(n)
        # Plain backprop and a fractional budget refer to the graph as it is,
        # where the pinned tensors are not kept.
        plain = plain_peak(graph)
        budget = options.get("budget")
        if budget is not None and 0 < budget < 1:
            options["budget"] = budget * plain
        plan = registry.run(_resolve(inner), g, **options)
        plan.checkpoints = topological(graph, set(plan.checkpoints) | set(pinned))
        plan.forced = [n for n in plan.forced if n not in set(pinned)]
        plan.plain_peak_bytes = int(plain)
        plan.strategy = strategy.strategy_name
        return plan

    return _named(strategy, "always_keep(%s) then %s" % (_describe(selectors), _label(then)))


def combine(*strategies):
    """Keep every tensor that any of ``strategies`` (names or callables) keeps."""
    if len(strategies) < 2:
        raise ValueError("combine needs at least two strategies")
    for s in strategies:
        if not isinstance(s, str) and not callable(s):
            raise TypeError("combine takes strategy names or callables, got %r" % (s,))

    def strategy(graph, **options):
        offload, model = options.pop("offload", None), options.pop("model", None)
        kept = set()
        for s in strategies:
            inner = _resolve(s)
            own = {k: v for k, v in options.items()
                   if k not in registry.STRICT_OPTIONS or registry.accepts(inner, k)}
            kept.update(registry.run(inner, graph, **own).checkpoints)
        plan = plan_for(graph, kept, label)
        if offload == "auto":
            plan = with_offload(graph, plan, None, model)
        return plan

    label = "combine(%s)" % ", ".join(_label(s) for s in strategies)
    return _named(strategy, label)


def _label(strategy):
    return strategy if isinstance(strategy, str) else registry.label(strategy)
