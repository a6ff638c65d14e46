"""TF graph editing primitives (the part of memsave that touches TF graphs)."""

from memsave.graph.edit import add_control_inputs, copy_ops, graph_tensor, open_sessions
from memsave.graph.stateful import is_pinned, written_handles
from memsave.graph.walk import as_op, backward_ops, forward_ops, refs, topo_order

__all__ = [
    "add_control_inputs", "as_op", "backward_ops", "copy_ops", "forward_ops",
    "graph_tensor", "is_pinned", "open_sessions", "refs", "topo_order", "written_handles",
]
