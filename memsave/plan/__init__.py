"""Framework-free checkpoint planning over a networkx DAG of tensors."""

from memsave.plan.offload import OffloadModel
from memsave.plan.optimal import BudgetError, optimal
from memsave.plan.plan import Plan
from memsave.plan.simulate import simulate_peak
from memsave.plan.strategies import (
    SPEED_OP_TYPES, NoBottleneckError, bottlenecks, explicit, memory, speed, with_offload)

__all__ = [
    "BudgetError", "OffloadModel", "Plan", "NoBottleneckError", "optimal", "SPEED_OP_TYPES",
    "bottlenecks", "simulate_peak", "explicit", "memory", "speed", "with_offload",
]
