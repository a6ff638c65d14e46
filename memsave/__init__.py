"""memsave: gradient checkpointing for TensorFlow 2 graphs.

Importing memsave changes nothing: no patching, no global settings, and no
TensorFlow until a name that needs it is used (``memsave.planning``, the
planners, and ``memsave.errors`` never load it).
"""

import importlib
import logging

from memsave.errors import (BudgetError, GradientMismatchError, NoBottleneckError,
                            PlanGraphError, StrategyError, TapeNoBottleneckError,
                            V1ControlFlowError)
from memsave.planning.offload import OffloadModel
from memsave.planning.plan import Plan

logging.getLogger("memsave").addHandler(logging.NullHandler())

__version__ = "0.1.0"

# Public names whose modules import TensorFlow (or Keras): loaded on first use.
_LAZY = {
    "gradients": "memsave.api", "gradients_collection": "memsave.api",
    "gradients_memory": "memsave.api", "gradients_speed": "memsave.api",
    "plan": "memsave.api", "register_strategy": "memsave.planning.registry",
    "patch": "memsave.patching", "unpatch": "memsave.patching",
    "GradientTape": "memsave.tape", "budgeted": "memsave.budget",
}
_SUBMODULES = ("api", "budget", "graph", "keras", "log", "patching", "planning", "profile",
               "reversible", "rewrite", "settings", "tape", "tf_internal")


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module("memsave." + name)
    raise AttributeError("module 'memsave' has no attribute %r" % (name,))


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))


__all__ = [
    "BudgetError", "GradientMismatchError", "GradientTape", "NoBottleneckError", "OffloadModel",
    "Plan", "PlanGraphError", "StrategyError", "TapeNoBottleneckError", "V1ControlFlowError",
    "budgeted", "gradients", "gradients_collection", "gradients_memory", "gradients_speed", "patch", "plan",
    "register_strategy", "unpatch",
]
