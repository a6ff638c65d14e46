"""Framework-free checkpoint planning over a :class:`PlanGraph` of tensors.

Nothing here imports TensorFlow: the TF side (``memsave.graph``) exports a
region of a graph as a PlanGraph, a strategy returns a :class:`Plan`, and
``memsave.rewrite`` executes it.
"""

from memsave.errors import BudgetError, NoBottleneckError, PlanGraphError, StrategyError
from memsave.planning.dag import FIELDS, PlanGraph, TensorNode
from memsave.planning.offload import OffloadModel
from memsave.planning.optimal import optimal
from memsave.planning.plan import Plan
from memsave.planning.policies import (always_keep, combine, keep_expensive, keep_names,
                                       keep_op_types, matching, never_keep)
from memsave.planning.registry import (register_strategy, run, strategy_names,
                                       unregister_strategy)
from memsave.planning.simulate import simulate_peak
from memsave.planning.strategies import (bottlenecks, explicit, memory, plan_for, speed,
                                         speed_candidates, with_offload)

__all__ = [
    "BudgetError", "FIELDS", "NoBottleneckError", "OffloadModel", "Plan", "PlanGraph",
    "PlanGraphError", "StrategyError", "TensorNode", "always_keep", "bottlenecks", "combine",
    "explicit", "keep_expensive", "keep_names", "keep_op_types", "matching", "memory",
    "never_keep", "optimal", "plan_for",
    "register_strategy", "run", "simulate_peak", "speed", "speed_candidates", "strategy_names",
    "unregister_strategy", "with_offload",
]
