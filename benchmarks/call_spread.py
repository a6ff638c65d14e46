"""How much one plan's calls vary, and how often a later call passes the budget loop's margin.

``python -m benchmarks.call_spread`` (``--model BERT``, ``--calls 40``):
GPT2 at 4 x 128 tokens (``benchmarks.budget_limit``'s quick step: SGD
updates inside the ``tf.function``, which the zoo's steps lack), one process:
plain's step peak, then ``memsave.budgeted`` with a byte budget of
``--fraction`` x plain's peak, called until its loop settles and then
``--calls`` times more, each call's peak measured (``memsave.profile``).

For every choice of k of those calls as the loop's measured ones (k = 2, 3),
with the plan's largest measured call placed at the margin the loop accepts
(5% of the budget, or the calls' spread times m where that is more), the
share of the other calls that measure over the budget: what a plan that just
passes the loop would see later. Writes ``benchmarks/results/call_spread.{json,md}``.
"""

import itertools
import sys

from benchmarks import cli

MIB = 2 ** 20
RULES = ((2, 0.0), (3, 0.0), (3, 1.0), (3, 1.5))   # (measured calls, SPREAD_MARGIN)


def over_share(peaks, calls, spread_margin, aim=0.95):
    """The mean share of the other calls over the budget, over every choice of
    ``calls`` measured ones, the budget placed where the loop's margin puts it."""
    shares = []
    for chosen in itertools.combinations(range(len(peaks)), calls):
        measured = [peaks[i] for i in chosen]
        largest, spread = max(measured), max(measured) - min(measured)
        # The smallest budget the loop would accept this plan under.
        budget = max(largest / aim, largest + spread_margin * spread)
        rest = [p for i, p in enumerate(peaks) if i not in chosen]
        shares.append(sum(p > budget for p in rest) / len(rest))
    return sum(shares) / len(shares)


def measure(name, fraction, calls):
    """Plain's peak, the settled plan's per-call peaks (% of the budget) and the loop's."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import memsave  # pylint: disable=import-outside-toplevel
    from memsave.profile import measured_call, peak_memory  # pylint: disable=C0415
    from benchmarks.budget_limit import QUICK_SIZES, _step  # pylint: disable=C0415
    from benchmarks.zoo import _build  # pylint: disable=import-outside-toplevel
    model, x, y, loss_fn = _build(name, *QUICK_SIZES[name])
    plain = peak_memory(_step(model, x, y, loss_fn, learning_rate=0.0))
    budget = int(fraction * plain)
    step = memsave.budgeted(_step(model, x, y, loss_fn, budget=budget))
    while not step.loop.done:
        step()
    later = [measured_call(step)[1] for _ in range(calls)]   # each call's outputs dropped
    return dict(model=name, plain_mib=plain / MIB, budget_mib=budget / MIB,
                loop_pct=[100 * p / budget for p in step.loop.peaks],
                replans=step.loop.replans, later_pct=[100 * p / budget for p in later])


def markdown(row):
    later = row["later_pct"]
    lines = ["%s (quick size, SGD), budget %.1f MiB (%.2f x plain's %.1f MiB): the loop's "
             "calls %s%% (%d replan(s)); %d later calls of the settled plan %.1f-%.1f%% of "
             "the budget." % (row["model"], row["budget_mib"], row["budget_mib"] /
                              row["plain_mib"], row["plain_mib"],
                              " ".join("%.1f" % p for p in row["loop_pct"]), row["replans"],
                              len(later), min(later), max(later)), "",
             "| measured calls | spread margin | later calls over the budget |",
             "|---:|---:|---:|"]
    lines += ["| %d | %.1f | %.1f%% |" % (k, m, 100 * share)
              for (k, m), share in zip(RULES, row["over"])]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = cli.parser(__doc__)
    parser.add_argument("--model", default="GPT2")
    parser.add_argument("--fraction", type=float, default=0.52)
    parser.add_argument("--calls", type=int, default=40)
    args = cli.parse(parser, argv)
    cli.environment()
    row = measure(args.model, args.fraction, args.calls)
    row["over"] = [over_share(row["later_pct"], k, m) for k, m in RULES]
    text = markdown(row)
    cli.write(args.out, "call_spread", row, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
