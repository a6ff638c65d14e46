"""memsave: gradient checkpointing for TensorFlow 2 graphs.

Importing memsave changes nothing: no patching, no global settings.
"""

import logging

from memsave.api import (gradients, gradients_collection, gradients_memory,
                         gradients_speed, plan)
from memsave.patch import patch, unpatch
from memsave.plan import NoBottleneckError, Plan

logging.getLogger("memsave").addHandler(logging.NullHandler())

__version__ = "0.1.0"

__all__ = [
    "NoBottleneckError", "Plan", "gradients", "gradients_collection", "gradients_memory",
    "gradients_speed", "patch", "plan", "unpatch",
]
