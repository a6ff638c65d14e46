"""The result of a strategy: what to keep, and what we expect it to cost."""

import dataclasses

# The least a named strategy's plan must be estimated below plain backprop's
# peak, as a fraction of it, to be run where no budget or recompute cap
# bounds the trade (see Plan.worse_than_plain). Plans estimated closer
# measured no lower on models memsave was not tuned on (one process each,
# CPU): VGG16 at batch 4, 0.6% below, measured 12-16% above plain (a 72 MiB
# weight gradient in a 112 MiB allocator chunk); InceptionV3 at batch 4,
# 6.2% below, 1-5% above; 'memory' on NASNetMobile, 0.2-1.7% below while
# recomputing a third of a step, 6% below to 1% above. The model zoo's
# plans are estimated at most 86% of plain's.
MIN_SAVING = 0.10


@dataclasses.dataclass
class Plan:
    """Checkpoints chosen by a strategy, with memory estimates.

    ``checkpoints`` are tensor names in topological order, chosen by the
    strategy; ``forced`` are tensors that must be kept whatever the strategy
    (outputs of ops that must not be recomputed). Byte estimates count
    activations, their gradients and the gradient pieces of the xs, not the
    xs themselves, from the shapes the planning graph carries
    (``unknown_dims`` counts tensors sized with a guess).
    ``offloaded`` are kept tensors that wait in host memory between the
    forward pass and their use; the estimated peak is then device memory,
    and ``host_bytes`` what the host holds.
    """

    strategy: str
    checkpoints: list
    forced: list = dataclasses.field(default_factory=list)
    estimated_peak_bytes: int = 0
    plain_peak_bytes: int = 0
    notes: list = dataclasses.field(default_factory=list)
    recompute_fraction: float = None  # recomputed work / a training step's, if estimated
    offloaded: list = dataclasses.field(default_factory=list)   # kept in host memory
    host_bytes: int = 0   # host memory the offloaded tensors take
    unknown_dims: int = 0   # tensors sized with a guess for some dimension

    def worse_than_plain(self, margin=0.0):
        """True when the estimate, made on known sizes, is not below plain
        backprop's by at least ``margin`` of it (:data:`MIN_SAVING` where no
        budget or cap is set: a smaller saving is within the estimate's
        error)."""
        return (not self.unknown_dims and self.plain_peak_bytes > 0
                and self.estimated_peak_bytes >= (1 - margin) * self.plain_peak_bytes)

    @property
    def kept(self):
        """Every tensor kept for the backward pass: chosen plus forced."""
        seen = set(self.checkpoints)
        return list(self.checkpoints) + [n for n in self.forced if n not in seen]

    def summary(self):
        def mib(b):
            return "%.1f MiB" % (b / 2**20)
        lines = ["memsave plan (%s): %d checkpoint(s), %d forced" % (
            self.strategy, len(self.checkpoints), len(self.forced))]
        lines.append("  estimated backward peak: %s (plain: %s)" % (
            mib(self.estimated_peak_bytes), mib(self.plain_peak_bytes)))
        if self.offloaded:
            lines.append("  offloads %d tensor(s) to the host: %s" % (
                len(self.offloaded), mib(self.host_bytes)))
        if self.recompute_fraction is not None:
            lines.append("  recomputes about %.1f%% of a training step's work"
                         % (100 * self.recompute_fraction))
        shown = ", ".join(self.checkpoints[:8]) + (" ..." if len(self.checkpoints) > 8 else "")
        if shown:
            lines.append("  checkpoints: " + shown)
        lines.extend("  note: " + n for n in self.notes)
        return "\n".join(lines)

    __str__ = summary

