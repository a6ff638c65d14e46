"""Which budgets a plan can land in: every plan the planner makes, measured.

Run ``python -m benchmarks.budget_sweep`` (``--models GPT2,BERT``,
``--budgets 0.3,0.5,0.7``, ``--step 0.025``, ``--quick`` for the zoo's small
sizes; ``--zoo STEM`` names the zoo run whose budget rows it is read
against, default ``zoo_budgets``; ``--merge`` adds the models run to the
stored results, ``--render`` rewrites the table from them, read against the
``--zoo`` run as it is now).

Issue 29 asks that a byte budget settle within 10% below itself "where a
plan that close exists". A budget loop (:mod:`memsave.budget`) sees one
plan's measured peak and replans once, so whether a plan that close exists
is a question of its own. Here, in one process per model (the zoo's step,
:func:`benchmarks.zoo.training_steps`):

1. plain's step is measured (the largest peak of three calls);
2. one trace plans ``'optimal'`` for targets from ``--lowest`` to
   ``--highest`` times plain's *estimated* peak in steps of ``--step``,
   plus the lowest plan, each as ``memsave.plan`` makes it; the distinct
   kept sets are the plans a budget can be given;
3. each distinct plan runs as its own step (``memsave.gradients`` with that
   list of tensors, the same rewrite), measured as the loop measures: the
   largest peak of three calls. The plans run one after another in one
   process, as a budget loop's plans do, so a peak includes what the
   allocator's earlier chunks cost it (BFC uses a free chunk under twice a
   request whole: a GPT2 plan at 1,024 tokens measured 408 MiB here and 336
   alone in a fresh process); one more call runs under the profiler, to
   tell the tensors at its peak from the allocator's chunk slack;
4. for each budget, a fraction of plain's measured peak: the plans whose
   measured peak is at most the budget, the closest of them, and whether
   one lies within 10% below it, beside where the zoo's loop settled (the
   ``--zoo`` run's row, where it has one; another process, so its target
   differs a little).

Writes ``benchmarks/results/budget_sweep.{json,md}``.
"""

import argparse
import json
import pathlib
import statistics
import subprocess
import sys

from benchmarks import cli

cli.environment()

from memsave import budget as budget_loop   # pylint: disable=wrong-import-position

MIB = 2 ** 20
MODELS = ("ResNet50", "DenseNet121", "MobileNetV2", "EfficientNetB0", "ConvNeXtTiny", "GPT2",
          "BERT", "ResNet50@224", "GPT2@1024", "BERT@1024")
BUDGETS = (0.3, 0.5, 0.7)
BAND = 0.10          # "within 10% below" the budget
AIM = budget_loop.AIM              # the most of it a budget loop keeps a plan at
CALLS = budget_loop.MEASURED_CALLS  # measured calls per plan, the largest taken
LANDING_SECTION, PLANS_SECTION = "Where budgets land", "Plans"
ERROR_SECTION = "What a plan's measured peak is made of"


def _targets(lowest, highest, step):
    count = int(round((highest - lowest) / step))
    return [round(lowest + i * step, 6) for i in range(count + 1)]


def child(name, quick, targets):
    """One model's plans and their measured peaks (JSON on stdout)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import memsave  # pylint: disable=import-outside-toplevel
    from memsave.profile import measured_call, profiled_call  # pylint: disable=C0415
    from benchmarks import zoo  # pylint: disable=import-outside-toplevel

    batch, size = (zoo.QUICK_SIZES if quick else zoo.SIZES)[name]
    model, x, y, loss_fn = zoo._build(name, batch, size)   # pylint: disable=protected-access
    inputs = [tf.constant(a) for a in x] if isinstance(x, list) else tf.constant(x)
    labels, weights = tf.constant(y), model.trainable_variables

    def measured(step):
        """The largest peak of CALLS calls, and what one more call's peak is made
        of: tensors (outputs ops asked for), the allocator's chunk slack, the
        rest (temporaries: kernel scratch, and Einsum's result, which it
        allocates as one and hands on); MiB, empty where the profiler is
        unavailable."""
        step()   # traced, Grappler, one-time allocations
        peak = max(measured_call(step)[1] for _ in range(CALLS))
        breakdown = profiled_call(step, strict=False)[1]
        if breakdown is None:
            return peak, {}
        outputs = sum(n for op, kind, n, _ in breakdown.live if op is not None and kind == "output")
        return peak, dict(tensors_mib=(outputs - breakdown.slack) / MIB,
                          slack_mib=breakdown.slack / MIB,
                          scratch_mib=max(0, breakdown.peak - outputs) / MIB)

    @tf.function
    def plain():
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(inputs, training=True))
        return [g for g in tape.gradient(loss, weights) if g is not None]

    plain_peak, plain_parts = measured(plain)
    plans, seen = [], {}

    @tf.function
    def planning():
        loss = loss_fn(labels, model(inputs, training=True))
        options = [("lowest", {})] + [(t, {"budget": t}) for t in targets]
        for target, extra in options:
            try:
                plan = memsave.plan(loss, weights, checkpoints="optimal", **extra)
            except memsave.BudgetError:
                continue
            key = tuple(sorted(plan.kept))
            if key in seen:
                plans[seen[key]]["targets"].append(target)
                continue
            seen[key] = len(plans)
            plans.append(dict(targets=[target], kept=list(plan.kept),
                              estimated_mib=plan.estimated_peak_bytes / MIB,
                              plain_estimated_mib=plan.plain_peak_bytes / MIB,
                              recompute=plan.recompute_fraction))
        return loss

    planning.get_concrete_function()
    for plan in plans:
        kept = plan.pop("kept")

        @tf.function
        def step(kept=kept):
            loss = loss_fn(labels, model(inputs, training=True))
            graph = loss.graph
            listed = [graph.get_tensor_by_name(n) for n in kept]
            return [g for g in memsave.gradients(loss, weights, checkpoints=listed)
                    if g is not None]

        plan["checkpoints"] = len(kept)
        peak, parts = measured(step)
        plan["measured_mib"] = peak / MIB
        plan.update(parts)
        del step
    return dict(model=name, batch=batch, size=size, plain_mib=plain_peak / MIB, plans=plans,
                plain_parts=plain_parts)


def landing(result, fraction):
    """Where plans land against ``fraction`` × plain's measured peak: the
    closest plan at or below it, and whether one is within :data:`BAND` below."""
    budget = fraction * result["plain_mib"]
    under = [p for p in result["plans"] if p["measured_mib"] <= budget]
    best = max(under, key=lambda p: p["measured_mib"]) if under else None
    lowest = min(result["plans"], key=lambda p: p["measured_mib"])
    kept_band = [p for p in under if (1 - BAND) * budget <= p["measured_mib"] <= AIM * budget]
    return dict(budget_mib=budget, best=best, lowest_mib=lowest["measured_mib"],
                exists=best is not None and best["measured_mib"] >= (1 - BAND) * budget,
                in_kept_band=bool(kept_band))


def _zoo_rows(path):
    """{(model, fraction): row} of a stored zoo run's budget rows."""
    if not path.exists():
        return {}
    rows = {}
    for row in json.loads(path.read_text())["summary"]:
        if row["config"].startswith("budget "):
            rows[(row["model"], float(row["config"].split()[1]))] = row
    return rows


def markdown(results, budgets, zoo_rows, machine):
    lines = ["Every plan 'optimal' makes for a budget, measured (the zoo's step, float32, %s): "
             "plans for targets across plain's estimated peak, each distinct kept set run as "
             "its own step, its peak the largest of %d calls (MiB above the pre-step "
             "baseline). For each budget (a fraction of plain's measured peak in the same "
             "process): the closest plan measured at or below it, whether one lies within "
             "10%% below it, and one in the band a budget loop keeps a plan in (90-95%%: "
             "it leaves 5%% for later calls' variation), and where the zoo's budget loop "
             "settled in its own run (another process: its target differs by plain's "
             "spread)." % (machine, CALLS),
             "", "**%s**" % LANDING_SECTION, "",
             "| model | plans | budget | target MiB | closest plan at or below | "
             "a plan within 10% | one at 90-95% | lowest plan | the zoo's loop settled at |",
             "|---|---:|---|---:|---:|---|---|---:|---|"]
    for result in results:
        for fraction in budgets:
            land = landing(result, fraction)
            best = land["best"]
            zoo = zoo_rows.get((result["model"], fraction))
            if zoo is None:
                settled = ""
            elif "error" in zoo:
                settled = "BudgetError"
            else:
                settled = "%.1f of %.1f (%.0f%%)" % (zoo["peak_median"], zoo["budget_mib"],
                                                    100 * zoo["peak_median"] / zoo["budget_mib"])
            lines.append("| %s | %d | %.1f × plain | %.1f | %s | %s | %s | %.1f | %s |" % (
                result["model"], len(result["plans"]), fraction, land["budget_mib"],
                "%.1f (%.0f%%)" % (best["measured_mib"], 100 * best["measured_mib"]
                                   / land["budget_mib"]) if best else "none",
                "yes" if land["exists"] else "no", "yes" if land["in_kept_band"] else "no",
                land["lowest_mib"], settled))
    lines += _error_table(results)
    lines += ["", "**%s**" % PLANS_SECTION, "",
              "Each model's plans (estimated → measured MiB, recomputed share of a step):", ""]
    for result in results:
        plans = sorted(result["plans"], key=lambda p: p["estimated_mib"])
        lines.append("- %s (plain %.1f MiB measured, %.1f estimated): %s" % (
            result["model"], result["plain_mib"], plans[0]["plain_estimated_mib"] if plans else 0,
            ", ".join("%.1f→%.1f%s" % (p["estimated_mib"], p["measured_mib"],
                                       "" if p["recompute"] is None
                                       else " (%.0f%%)" % (100 * p["recompute"]))
                      for p in plans)))
    return "\n".join(lines) + "\n"


def _spread(values, fmt="%.2f"):
    """'median (min-max)' of ``values``."""
    values = sorted(values)
    return (fmt + " (" + fmt + "-" + fmt + ")") % (statistics.median(values), values[0], values[-1])


def _error_table(results):
    """Per model whose plans were profiled: the tensors at a plan's measured
    peak against its estimate, the allocator's chunk slack, the allocations
    made as temporaries, and the measured peak against the estimate, over
    its plans (the lowest plan apart)."""
    profiled = [r for r in results if r["plans"] and all("slack_mib" in p for p in r["plans"])]
    if not profiled:
        return []
    lines = ["", "**%s**" % ERROR_SECTION, "",
             "One more call of each plan under the profiler: the tensors alive at its "
             "peak (what ops asked for) against the plan's estimate, the allocator's "
             "chunk slack (BFC hands out a free chunk under twice a request whole), "
             "the rest (allocations made as temporaries: kernels' scratch, and "
             "results some kernels hand on as outputs, Einsum's), and the measured "
             "peak against the estimate; median (range) over the plans but the "
             "lowest, which is given apart.", "",
             "| model | plans | tensors vs estimate | slack MiB | temporaries MiB | "
             "measured vs estimate | lowest plan: tensors vs estimate, slack MiB | "
             "plain: slack MiB |",
             "|---|---:|---|---|---|---|---|---:|"]
    for r in profiled:
        plans = sorted(r["plans"], key=lambda p: p["estimated_mib"])
        lowest, rest = plans[0], plans[1:] or plans
        lines.append("| %s | %d | %s | %s | %s | %s | %.2f, %.1f | %s |" % (
            r["model"], len(plans),
            _spread([p["tensors_mib"] / p["estimated_mib"] for p in rest]),
            _spread([p["slack_mib"] for p in rest], "%.1f"),
            _spread([max(0.0, p["scratch_mib"]) for p in rest], "%.1f"),
            _spread([p["measured_mib"] / p["estimated_mib"] for p in rest]),
            lowest["tensors_mib"] / lowest["estimated_mib"], lowest["slack_mib"],
            "%.1f" % r["plain_parts"]["slack_mib"] if r.get("plain_parts") else ""))
    return lines


def _run_child(name, quick, targets):
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.budget_sweep", "--child", name,
         "--targets", ",".join(map(str, targets))] + (["--quick"] if quick else []),
        capture_output=True, text=True, check=False,
        cwd=pathlib.Path(__file__).resolve().parent.parent)
    lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError("%s failed:\n%s" % (name, out.stderr[-3000:]))
    return json.loads(lines[-1])


def main(argv=None):
    parser = cli.parser(__doc__)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    parser.add_argument("--lowest", type=float, default=0.2,
                        help="smallest target, times plain's estimated peak")
    parser.add_argument("--highest", type=float, default=0.9)
    parser.add_argument("--step", type=float, default=0.025)
    parser.add_argument("--quick", action="store_true", help="the zoo's small sizes")
    parser.add_argument("--zoo", default="zoo_budgets",
                        help="the stored zoo run (STEM.json in --out) to read against")
    parser.add_argument("--stem", default=None)
    parser.add_argument("--merge", action="store_true",
                        help="add these models to the stored STEM.json (replacing their "
                        "earlier results) instead of starting afresh")
    parser.add_argument("--render", action="store_true",
                        help="rewrite STEM.md from the stored STEM.json and the --zoo run "
                        "(no run)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--targets", help=argparse.SUPPRESS)
    args = cli.parse(parser, argv)
    if args.child:
        targets = [float(t) for t in args.targets.split(",")]
        print(json.dumps(child(args.child, args.quick, targets)))
        return 0
    from benchmarks.models import machine_info  # pylint: disable=import-outside-toplevel
    from benchmarks.zoo import _machine_line  # pylint: disable=import-outside-toplevel
    out = pathlib.Path(args.out)
    stem = args.stem or ("budget_sweep_quick" if args.quick else "budget_sweep")
    stored = out / (stem + ".json")
    if args.render:
        data = json.loads(stored.read_text())
        text = markdown(data["results"], data["budgets"], _zoo_rows(out / (args.zoo + ".json")),
                        _machine_line(data["machine"]))
        (out / (stem + ".md")).write_text(text)
        print(text)
        return 0
    targets = _targets(args.lowest, args.highest, args.step)
    results = []
    for name in args.models.split(","):
        print("%s: %d targets" % (name, len(targets)), file=sys.stderr, flush=True)
        results.append(_run_child(name, args.quick, targets))
    budgets = [float(b) for b in args.budgets.split(",")]
    machine = machine_info()
    if args.merge and stored.exists():
        ran = {r["model"] for r in results}
        results = [r for r in json.loads(stored.read_text())["results"]
                   if r["model"] not in ran] + results
        order = {name: i for i, name in enumerate(MODELS)}
        results.sort(key=lambda r: order.get(r["model"], len(order)))
    text = markdown(results, budgets, _zoo_rows(out / (args.zoo + ".json")),
                    _machine_line(machine))
    cli.write(out, stem, {"machine": machine, "budgets": budgets, "results": results}, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
