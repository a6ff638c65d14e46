"""What is live at the measured peak of zoo models' steps, plain and memsave, against the plan's estimate.

For each model (default: ConvNeXtTiny, whose estimate is furthest below its
measured peak in the zoo) and each configuration, one training step as in
``benchmarks.zoo`` (``memsave.GradientTape`` in ``tf.function``, float32) is
measured and broken down with ``memsave.profile.peak_breakdown``: the bytes
alive at the peak that ops are named for (the tensors a plan's estimate
models), those no op is named for (kernel scratch, the buffers of
XLA-compiled calls), and the largest named allocations. Writes
``benchmarks/results/peak_breakdown.{json,md}``.

    python -m benchmarks.peak_breakdown [--models ConvNeXtTiny;ResNet50] [--budgets 0.45]
        [--stem peak_breakdown]
"""

import logging
import re
import time

from benchmarks import cli

CONFIGS = (("plain", None), ("optimal", "optimal"))
MIB = 2 ** 20
_ESTIMATE = re.compile(r"estimated backward peak: ([0-9.]+) MiB \(plain: ([0-9.]+) MiB\)")


class _Estimates(logging.Handler):
    """(plan's, plain's) estimated peaks in the plan memsave logs (MB: MiB)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.found = []

    def emit(self, record):
        match = _ESTIMATE.search(record.getMessage())
        if match:
            self.found.append((float(match.group(1)), float(match.group(2))))


def measure(name, budgets=()):
    """The rows of one zoo model, one per configuration (and one per fraction
    in ``budgets``: 'optimal' planned for that fraction of plain's estimated
    peak, as a budget loop's trace plans)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import memsave  # pylint: disable=import-outside-toplevel
    from memsave.profile import peak_breakdown  # pylint: disable=import-outside-toplevel
    from benchmarks import zoo  # pylint: disable=import-outside-toplevel

    batch, size = zoo.SIZES[name]
    model, x, y, loss_fn = zoo._build(name, batch, size)  # pylint: disable=protected-access
    inputs = [tf.constant(a) for a in x] if isinstance(x, list) else tf.constant(x)
    labels = tf.constant(y)
    estimates = _Estimates()
    logger = logging.getLogger("memsave")
    logger.addHandler(estimates)
    logger.setLevel(logging.INFO)
    rows = []
    configs = [(label, checkpoints, {}) for label, checkpoints in CONFIGS] + [
        ("budget %g × plain's estimate" % f, "optimal", {"budget": f}) for f in budgets]
    for label, checkpoints, options in configs:
        @tf.function
        def step(checkpoints=checkpoints, options=options):
            tape = (tf.GradientTape() if checkpoints is None
                    else memsave.GradientTape(checkpoints=checkpoints, **options))
            with tape:
                loss = loss_fn(labels, model(inputs, training=True))
            return [g for g in tape.gradient(loss, model.trainable_variables) if g is not None]

        estimates.found.clear()
        breakdown = peak_breakdown(step, warmup=2)
        named = [row for row in breakdown.live if row[0]]
        rows.append({"model": name, "config": label,
                     "measured_mib": breakdown.peak / MIB,
                     "estimated_mib": estimates.found[-1][0] if estimates.found else None,
                     "named_mib": sum(row[2] for row in named) / MIB,
                     "unnamed_mib": breakdown.unnamed / MIB,
                     "at": breakdown.at,
                     "largest": [[op, kind, nbytes / MIB, count]
                                 for op, kind, nbytes, count in named[:5]],
                     "slack_mib": breakdown.slack / MIB,
                     "summary": breakdown.summary(top=12)})
    logger.removeHandler(estimates)
    if estimates.found:   # plain's estimate, from the last plan
        rows[0]["estimated_mib"] = estimates.found[-1][1]
    return rows


def table(rows):
    lines = ["Peak breakdown (memsave.profile.peak_breakdown), MiB above the step's baseline: "
             "allocations alive at the measured peak, named by op or not (kernel scratch, "
             "the buffers of XLA-compiled calls), and the bytes of their chunks beyond what "
             "they asked for (BFC hands out a free chunk whole when it is under twice the "
             "request)", "",
             "| model | config | measured | estimated | named at the peak | unnamed at the peak "
             "| chunk slack |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append("| %s | %s | %.1f | %s | %.1f | %.1f | %.1f |" % (
            r["model"], r["config"], r["measured_mib"],
            "%.1f" % r["estimated_mib"] if r["estimated_mib"] is not None else "-",
            r["named_mib"], r["unnamed_mib"], r["slack_mib"]))
    return "\n".join(lines) + "\n"


def main(argv=None):
    cli.environment()
    arguments = cli.parser(__doc__)
    arguments.add_argument("--models", default="ConvNeXtTiny",
                           help="zoo entries separated by ';'")
    arguments.add_argument("--budgets", default="",
                           help="fractions of plain's estimated peak to plan for too, "
                                "separated by ','")
    arguments.add_argument("--stem", default="peak_breakdown", help="results file name")
    args = cli.parse(arguments, argv)
    start = time.time()
    rows = []
    budgets = [float(f) for f in args.budgets.split(",") if f]
    for name in args.models.split(";"):
        rows += measure(name, budgets)
    markdown = table(rows)
    for r in rows:
        print("%s, %s:\n%s\n" % (r["model"], r["config"], r["summary"]))
    cli.write(args.out, args.stem,
              {"rows": rows, "meta": {"seconds": time.time() - start}}, markdown)
    cli.report({"markdown": markdown, "meta": {"seconds": time.time() - start}},
               args.stem, args.out)


if __name__ == "__main__":
    main()
