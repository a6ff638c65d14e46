"""Framework-free checkpoint planning over a networkx DAG of tensors."""

from memsave.planning.offload import OffloadModel
from memsave.planning.optimal import BudgetError, optimal
from memsave.planning.plan import Plan
from memsave.planning.simulate import simulate_peak
from memsave.planning.strategies import (
    SPEED_OP_TYPES, NoBottleneckError, bottlenecks, explicit, memory, speed, with_offload)

__all__ = [
    "BudgetError", "OffloadModel", "Plan", "NoBottleneckError", "optimal", "SPEED_OP_TYPES",
    "bottlenecks", "simulate_peak", "explicit", "memory", "speed", "with_offload",
]
