"""Offloading: keep a checkpoint in host memory instead of on the device.

A third action next to *keep* and *recompute*. An offloaded tensor is
copied to the host right after the forward pass produces it (swap-out) and
copied back shortly before the backward pass reads it (swap-in), so between
the two it costs no device memory. Its price is transfer time, which can
overlap with compute; recomputing costs compute time on the critical path.

The cost model here is deliberately simple, per tensor:

* recompute seconds = work of its op (FLOP-equivalents, the planning
  graph's ``cost``) / ``device_flops``;
* transfer seconds = bytes / ``host_bandwidth`` (the swap-in is exposed, the
  swap-out overlaps the rest of the forward pass).

A tensor whose transfer is cheaper than recomputing it (a convolution or a
large matmul output: many FLOPs per byte) is *worth offloading*. Cheap
elementwise outputs are better recomputed.
"""

import dataclasses

# PCIe 4.0 x16 moves about 25 GB/s in practice; a current GPU runs float32
# convolutions at about 15 TFLOP/s (a FLOP-equivalent is a convolution's FLOP).
DEFAULT_HOST_BANDWIDTH = 25e9
DEFAULT_DEVICE_FLOPS = 1.5e13


@dataclasses.dataclass(frozen=True)
class OffloadModel:
    """How offloading runs and what it costs: ``offload_model=`` of every entry point.

    ``host_bandwidth`` (bytes/s) against ``device_flops`` decides what is
    worth offloading. Each swap-in starts ``swapin_ahead`` backward ops
    before its first reader (0: it waits for the reader, and the plan knows
    no swap-in arrives early) and is shared by readers at most
    ``swapin_groupby`` ops apart; swapped-out tensors wait on ``host_device``.
    """

    host_bandwidth: float = DEFAULT_HOST_BANDWIDTH
    device_flops: float = DEFAULT_DEVICE_FLOPS
    swapin_ahead: int = 1
    swapin_groupby: int = 5
    host_device: str = "/device:CPU:0"

    def __post_init__(self):
        for field in ("host_bandwidth", "device_flops"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError("%s must be a positive number, got %r" % (field, value))
        for field in ("swapin_ahead", "swapin_groupby"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError("%s must be an int >= 0, got %r" % (field, value))
        if not isinstance(self.host_device, str) or not self.host_device:
            raise TypeError("host_device must be a device name such as '/device:CPU:0', got %r"
                            % (self.host_device,))

    @property
    def prefetch(self):
        """Whether swap-ins start before the segment that needs them."""
        return self.swapin_ahead > 0

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
