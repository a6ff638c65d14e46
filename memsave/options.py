"""The settings that tapes, ``memsave.patch`` and Keras pass to :func:`memsave.gradients`.

Kept apart from :mod:`memsave.tape` so that :mod:`memsave.patching` and
:mod:`memsave.keras` can build and check a :class:`Config` (and read the
shared default) without depending on how a tape call is translated.
"""

import dataclasses
import inspect
import warnings

from memsave import api, verify

# The strategy of tapes, patch() and Keras: 'optimal' was as good as or
# better than the others on every model measured (memsave.gradients keeps
# 'collection' for parity with the original library).
DEFAULT_CHECKPOINTS = "optimal"

# Keyword-only planning options of memsave.gradients (e.g. 'budget',
# 'batch_size') that tapes pass along.
OPTION_NAMES = frozenset(
    name for name, p in inspect.signature(api.gradients).parameters.items()
    if p.kind is p.KEYWORD_ONLY and name not in ("min_checkpoint_size", "name"))


def renamed_strategy(checkpoints, kwargs, where):
    """``checkpoints``, or the value of the old ``strategy=`` keyword (popped)."""
    if "strategy" not in kwargs:
        return checkpoints
    value = kwargs.pop("strategy")
    warnings.warn("%s: strategy= is now called checkpoints=, as in memsave.gradients"
                  % where, DeprecationWarning, stacklevel=3)
    return value


@dataclasses.dataclass(frozen=True)
class Config:
    """What a tape passes to :func:`memsave.gradients`, checked when it is made.

    Checking here, not at the first ``gradient()`` call, reports a bad
    option where it was written rather than deep inside a traced step.
    """

    checkpoints: object = DEFAULT_CHECKPOINTS
    min_checkpoint_size: int = 1024
    options: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        api.check_checkpoints(self.checkpoints)
        if self.min_checkpoint_size < 0:
            raise ValueError("min_checkpoint_size must be >= 0, got %r"
                             % (self.min_checkpoint_size,))
        unknown = sorted(set(self.options) - OPTION_NAMES)
        if unknown:
            raise TypeError("unexpected option(s) %s; memsave.gradients accepts %s"
                            % (", ".join(unknown), ", ".join(
                                ["min_checkpoint_size"] + sorted(OPTION_NAMES))))
        verify.check_option(self.options.get("verify"))
        api.check_xla(self.options.get("xla"))

    @classmethod
    def make(cls, checkpoints=DEFAULT_CHECKPOINTS, min_checkpoint_size=1024, **options):
        return cls(checkpoints, min_checkpoint_size, dict(options))


def config_kwargs(kwargs):
    """The entries of ``kwargs`` (e.g. ``memsave.patch``'s) that tapes use."""
    return {k: v for k, v in kwargs.items() if k == "min_checkpoint_size" or k in OPTION_NAMES}
