"""Every exception memsave raises on purpose, in one place (no TensorFlow here).

Each subclasses the built-in type a caller would catch anyway (ValueError
for what the input asks, RuntimeError for a memsave bug). Their constructor
is ``Exception``'s: autograph re-raises such exceptions as themselves, not
as a ``StagingError``, when they cross a converted ``tf.function``, so
``except memsave.NoBottleneckError`` around the function call works.
"""


class _AutographReraisable:
    """``Exception``'s constructor, so autograph re-raises each error below as
    itself (see the module docstring)."""

    __init__ = Exception.__init__


class NoBottleneckError(_AutographReraisable, ValueError):
    """The 'memory' strategy found no single-tensor bottleneck to keep."""


class TapeNoBottleneckError(NoBottleneckError):
    """:class:`NoBottleneckError` raised by ``GradientTape.gradient`` (says which tape)."""


class BudgetError(_AutographReraisable, ValueError):
    """No plan fits the requested memory budget."""


class StrategyError(_AutographReraisable, ValueError):
    """A strategy (built-in or user-defined) returned something unusable."""


class PlanGraphError(_AutographReraisable, ValueError):
    """A planning graph breaks its schema (see :mod:`memsave.planning.dag`)."""


class V1ControlFlowError(_AutographReraisable, ValueError):
    """The region holds TF1 control flow that a gradient passes through, which
    memsave cannot recompute."""


class GradientMismatchError(_AutographReraisable, RuntimeError):
    """memsave's gradients would not have ``tf.gradients``' ``None`` pattern.

    Raised instead of returning them: a missing gradient trains silently
    wrong. It is a memsave bug; please report it with the graph.
    """


__all__ = ["BudgetError", "GradientMismatchError", "NoBottleneckError", "PlanGraphError",
           "StrategyError", "TapeNoBottleneckError", "V1ControlFlowError"]
