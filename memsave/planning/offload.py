"""Offloading: keep a checkpoint in host memory instead of on the device.

A third action next to *keep* and *recompute*. An offloaded tensor is
copied to the host right after the forward pass produces it (swap-out) and
copied back shortly before the backward pass reads it (swap-in), so between
the two it costs no device memory. Its price is transfer time, which can
overlap with compute; recomputing costs compute time on the critical path.

The cost model here is deliberately simple, per tensor:

* recompute seconds = FLOPs of its op / ``device_flops``;
* transfer seconds = bytes / ``host_bandwidth`` (the swap-in is exposed, the
  swap-out overlaps the rest of the forward pass).

A tensor whose transfer is cheaper than recomputing it (a convolution or a
large matmul output: many FLOPs per byte) is *worth offloading*. Cheap
elementwise outputs are better recomputed.
"""

import dataclasses

# PCIe 4.0 x16 moves about 25 GB/s in practice; a current GPU runs float32
# matmuls and convolutions at about 15 TFLOP/s.
DEFAULT_HOST_BANDWIDTH = 25e9
DEFAULT_DEVICE_FLOPS = 1.5e13


@dataclasses.dataclass(frozen=True)
class OffloadModel:
    """Transfer bandwidth against device speed, for choosing what to offload."""

    host_bandwidth: float = DEFAULT_HOST_BANDWIDTH
    device_flops: float = DEFAULT_DEVICE_FLOPS
    prefetch: bool = True   # swap-ins start before the segment that needs them

    def __post_init__(self):
        for field in ("host_bandwidth", "device_flops"):
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError("%s must be a positive number, got %r" % (field, value))

    def transfer_seconds(self, nbytes):
        return nbytes / self.host_bandwidth

    def recompute_seconds(self, flops):
        return flops / self.device_flops

    def worth_offloading(self, graph, name):
        """True if moving ``name`` to the host is cheaper than recomputing it."""
        data = graph.nodes[name]
        nbytes = data["bytes"] or 0
        return data["offloadable"] and nbytes > 0 and (
            self.transfer_seconds(nbytes) < self.recompute_seconds(data["cost"]))

    def seconds(self, graph, recompute_flops, offloaded):
        """Estimated extra step time: recomputation plus exposed transfers."""
        return (self.recompute_seconds(recompute_flops)
                + self.transfer_seconds(host_bytes(graph, offloaded)))


def offloadable(graph, names):
    """The tensors among ``names`` that can be offloaded, in the given order."""
    return [n for n in names if graph.nodes[n]["offloadable"]]


def host_bytes(graph, offloaded):
    return int(sum(graph.nodes[n]["bytes"] or 0 for n in offloaded))
