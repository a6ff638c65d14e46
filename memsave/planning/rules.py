"""Scheduling rules that the rewriter applies and the estimator models.

One definition, two users: ``memsave.graph.schedule`` adds the control
edges, ``memsave.planning.simulate`` counts the memory they free. If the two
decided by different criteria the estimate would describe a schedule that
never runs.
"""

# Activations below this size are not worth a control edge.
MIN_ACTIVATION_BYTES = 64 * 1024


def reducer_runs_first(activation_bytes, reduced_bytes, sibling_bytes):
    """Whether a gradient op that reads a forward activation and makes a small
    result (a weight gradient: ``reduced_bytes``) runs before its sibling
    that makes a large result without reading it (an input gradient:
    ``sibling_bytes``), so that the activation can be freed first.

    The gradient of ``y = matmul(x, w)`` (or a convolution) is two such ops;
    TensorFlow runs them in either order, and when the input gradient comes
    first ``x``, ``dy`` and ``dx`` are alive together.
    """
    return (activation_bytes >= MIN_ACTIVATION_BYTES
            and reduced_bytes * 4 <= activation_bytes
            and sibling_bytes * 4 >= activation_bytes)
