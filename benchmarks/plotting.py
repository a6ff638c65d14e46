"""One row of panels, one per model, for the benchmarks' PNGs (no screen needed)."""


def model_panels(models, width, height):
    """``(figure, axes)``: ``len(models)`` side-by-side panels, each ``width``
    by ``height`` inches, drawn off-screen (matplotlib's Agg backend)."""
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    fig, axes = plt.subplots(1, len(models), figsize=(width * len(models), height),
                             squeeze=False)
    return fig, axes[0]
