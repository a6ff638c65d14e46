"""memsave: gradient checkpointing for TensorFlow 2 graphs.

Importing memsave changes nothing: no patching, no global settings.
"""

import logging

from memsave.api import (GradientMismatchError, gradients, gradients_collection,
                         gradients_memory, gradients_speed, plan)
from memsave.graph.region import V1ControlFlowError
from memsave.patch import patch, unpatch
from memsave.plan import BudgetError, NoBottleneckError, Plan
from memsave.tape import GradientTape

logging.getLogger("memsave").addHandler(logging.NullHandler())

__version__ = "0.1.0"


def __getattr__(name):
    # ``memsave.keras`` imports Keras, so it is only loaded when asked for;
    # ``memsave.reversible`` likewise, to keep ``import memsave`` light.
    if name in ("keras", "reversible"):
        import importlib  # pylint: disable=import-outside-toplevel
        return importlib.import_module("memsave." + name)
    raise AttributeError("module 'memsave' has no attribute %r" % (name,))


__all__ = [
    "BudgetError", "GradientMismatchError", "GradientTape", "NoBottleneckError", "Plan", "V1ControlFlowError",
    "gradients", "gradients_collection", "gradients_memory", "gradients_speed", "patch", "plan", "unpatch",
]
