"""TF graph editing primitives (the part of memsave that touches TF graphs)."""

from memsave.graph.edit import copy_ops, graph_tensor, reaches_xs_through_captures
from memsave.graph.stateful import is_pinned, written_handles
from memsave.graph.walk import as_op, backward_ops, forward_ops, refs, topo_order

__all__ = [
    "as_op", "backward_ops", "copy_ops", "forward_ops", "graph_tensor", "is_pinned",
    "reaches_xs_through_captures", "refs", "topo_order", "written_handles",
]
