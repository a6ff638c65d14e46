"""Model zoo: plain vs each strategy, a budget and a recompute cap, on real models.

Run ``python -m benchmarks.zoo`` (``--models ResNet50,GPT2`` for a subset,
``--configs "budget 0.5 × plain;speed"`` for some configurations besides
plain, ``--stem`` to name the results file, ``--processes 3`` by default,
``--quick`` for small sizes and one process, ``--render`` to rewrite the
table and plot of a stored run, ``--merge`` to put the models run in place
of theirs in the stored run, the others' rows kept; with ``--configs``, only
those rows of the models run).
Each model runs in ``--processes`` child processes (plain TF's own peak
varies 10-30% between processes, so peaks are min / median / max over
them). In a child, one training step (forward, loss, gradients of every
trainable weight, ``memsave.GradientTape`` inside ``tf.function``, float32)
is traced per configuration:

* peak: ``memsave.profile.peak_memory`` (allocator peak above the pre-step
  baseline; BFC allocator, one inter-op thread);
* build: seconds of the first call (trace, plan and rewrite) minus one
  step;
* step-time ratio: the configuration's step against plain's, alternating
  pairs (plain first in one, second in the next), median ratio; a second
  plain function gives the plain-vs-plain
  row (the noise floor);
* gradients: whether memsave's rewrite ran, or memsave fell back to plain
  gradients (its log says so when a plan is not estimated below plain's);
* budget rows: the loop's measured calls, replans, and its log lines
  (``loop_said``: each plan's estimate and measured peak) in the JSON.

Sizes are chosen so that activations outweigh weights (``SIZES``). Writes
``benchmarks/results/zoo.{json,md}`` and ``zoo.png`` (peak against time per
model: the Pareto front).
"""

import argparse
import collections
import json
import logging
import pathlib
import statistics
import subprocess
import sys
import time

from benchmarks import cli

cli.environment()

MIB = 2 ** 20

# (label, checkpoints, options); plain first.
CONFIGS = (
    ("plain", None, {}),
    ("plain again", None, {}),
    ("optimal (default)", "optimal", {}),
    ("memory", "memory", {}),
    ("speed", "speed", {}),
    ("optimal, max_recompute=0.02", "optimal", {"max_recompute": 0.02}),
    ("optimal, max_recompute=0.05", "optimal", {"max_recompute": 0.05}),
    ("optimal, max_recompute=0.1", "optimal", {"max_recompute": 0.1}),
    ("optimal, max_recompute=0.2", "optimal", {"max_recompute": 0.2}),
    ("budget 0.3 × plain", "optimal", {"budget": 0.3}),
    ("budget 0.5 × plain", "optimal", {"budget": 0.5}),
    ("budget 0.7 × plain", "optimal", {"budget": 0.7}),
)
# The 'budget' rows: a byte budget, the fraction times plain's measured peak in
# the same process, kept on the allocator by memsave.budgeted (measured, then
# replanned once if over or more than 10% below; see memsave.budget).
BUDGET_ROWS = tuple(label for label, _, _ in CONFIGS if label.startswith("budget "))
# (batch, image side) per model: activations outweigh weights. ResNet50's
# weight gradients (about 90 MiB, held to the end of every plan) were a
# third of plain's peak at batch 8; at 32 they are under a tenth.
# For GPT2 and BERT the second figure is the sequence length (None: 128);
# 'x768' is GPT-2 small's width (768 hidden, 12 heads) instead of 256.
SIZES = {"ResNet50": (32, 128), "DenseNet121": (8, 128), "MobileNetV2": (16, 128),
         "EfficientNetB0": (8, 128), "ConvNeXtTiny": (8, 128), "GPT2": (8, None),
         "BERT": (8, None), "ResNet50@224": (32, 224), "GPT2@1024": (4, 1024),
         "BERT@1024": (4, 1024), "GPT2@1024x768": (2, 1024), "BERT@1024x768": (2, 1024)}
QUICK_SIZES = {name: (max(2, b // 4), s and s // 2) for name, (b, s) in SIZES.items()}
MODELS = tuple(SIZES)
# ResNet50 at ImageNet's resolution too, where its weight gradients are 3% of
# plain's peak (10% at 128 px): the default and the budget, each step 3x
# the 128 px one.
ONLY = {"ResNet50@224": ("plain", "plain again", "optimal (default)",
                         "budget 0.5 × plain")}
# GPT2 and BERT at 1,024 tokens, where attention scores (tokens² per head)
# dominate: the default, the cheap regime and the budgets; at GPT-2 small's
# width, the default and the cheap regime.
for _key in ("GPT2@1024", "BERT@1024"):
    ONLY[_key] = ("plain", "plain again", "optimal (default)", "optimal, max_recompute=0.02",
                  "optimal, max_recompute=0.05", "optimal, max_recompute=0.1",
                  "optimal, max_recompute=0.2") + BUDGET_ROWS
for _key in ("GPT2@1024x768", "BERT@1024x768"):
    ONLY[_key] = ("plain", "plain again", "optimal (default)", "optimal, max_recompute=0.02",
                  "optimal, max_recompute=0.05", "optimal, max_recompute=0.1")


def model_name(key):
    """The model a zoo entry builds ('ResNet50@224' is ResNet50 at 224 px)."""
    return key.split("@")[0]


def width(key):
    """A transformer entry's hidden size ('GPT2@1024x768': 768; else 256)."""
    return int(key.rsplit("x", 1)[1]) if "@" in key and "x" in key.split("@")[1] else 256


def configs(key, only=None):
    """The configurations run on zoo entry ``key`` (``only``: labels separated by ';')."""
    wanted = ("plain;" + only).split(";") if only else None
    return [c for c in CONFIGS if (key not in ONLY or c[0] in ONLY[key])
            and (wanted is None or c[0] in wanted)]


def _build(key, batch, size):
    import keras  # pylint: disable=import-outside-toplevel
    from benchmarks.zoo_models import APPLICATIONS, build  # pylint: disable=C0415
    name = model_name(key)
    if name in APPLICATIONS:
        return build(name, batch, dtype="float32", size=size)
    # The transformers: 4 layers, hidden 256 (64 per head) unless the key
    # says, 128 tokens unless ``size`` says.
    import keras_hub  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    keras.utils.set_random_seed(0)
    rng = np.random.RandomState(0)
    seq, hidden = size or 128, width(key)
    config = dict(vocabulary_size=1000, num_layers=4, num_heads=hidden // 64,
                  hidden_dim=hidden, intermediate_dim=4 * hidden, max_sequence_length=seq,
                  dropout=0.0)
    ids = rng.randint(0, 1000, (batch, seq)).astype("int32")
    tokens, mask = keras.Input((seq,), dtype="int32"), keras.Input((seq,), dtype="int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if name == "GPT2":
        backbone = keras_hub.models.GPT2Backbone(**config)
        hidden = backbone({"token_ids": tokens, "padding_mask": mask})
        model = keras.Model([tokens, mask], backbone.token_embedding(hidden, reverse=True))
        return model, [ids, np.ones_like(ids)], np.roll(ids, -1, axis=1), loss
    backbone = keras_hub.models.BertBackbone(**config)
    segments = keras.Input((seq,), dtype="int32")
    out = backbone({"token_ids": tokens, "segment_ids": segments, "padding_mask": mask})
    model = keras.Model([tokens, segments, mask], keras.layers.Dense(3)(out["pooled_output"]))
    return model, [ids, np.zeros_like(ids), np.ones_like(ids)], rng.randint(0, 3, batch), loss


def training_steps(name, quick=False):
    """``(batch, size, step_for)`` for zoo entry ``name``: ``step_for(checkpoints,
    options)`` makes a fresh ``tf.function`` training step (forward, loss,
    gradients of every trainable weight) under ``memsave.GradientTape``, or
    the plain tape where ``checkpoints`` is None."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import memsave  # pylint: disable=import-outside-toplevel

    batch, size = (QUICK_SIZES if quick else SIZES)[name]
    model, x, y, loss_fn = _build(name, batch, size)
    inputs = [tf.constant(a) for a in x] if isinstance(x, list) else tf.constant(x)
    labels = tf.constant(y)
    weights = model.trainable_variables

    def step_for(checkpoints, options):
        @tf.function
        def step():
            tape = (tf.GradientTape() if checkpoints is None
                    else memsave.GradientTape(checkpoints=checkpoints, **options))
            with tape:
                loss = loss_fn(labels, model(inputs, training=True))
            return [g for g in tape.gradient(loss, weights) if g is not None]
        return step
    return batch, size, step_for


def child(name, quick, pairs, only=None):
    """One model's rows in this process (JSON on stdout)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import memsave  # pylint: disable=import-outside-toplevel
    from memsave.profile import peak_memory  # pylint: disable=import-outside-toplevel
    from memsave.log import reset_warnings  # pylint: disable=import-outside-toplevel

    batch, size, step_for = training_steps(name, quick)

    def timed(fn):
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    said = _Said()
    logging.getLogger("memsave").addHandler(said)
    logging.getLogger("memsave").setLevel(logging.INFO)
    rows, steps = [], {}
    for label, checkpoints, options in configs(name, only):
        budget = None
        if label in BUDGET_ROWS:
            budget = int(options["budget"] * rows[0]["peak_mib"] * MIB)   # plain's, bytes
            step = memsave.budgeted(step_for(checkpoints, {"budget": budget}))
        else:
            step = step_for(checkpoints, options)
        said.lines.clear()
        reset_warnings()  # the tape's fallback warnings are once-only: say them per config
        try:
            calls = [timed(step)]   # the first traces
            retraced, traced = [], {id(getattr(step, "_step", step))}
            while budget and not step.loop.done:   # measured, replanned (see memsave.budget)
                fresh = id(step._step) not in traced   # pylint: disable=protected-access
                traced.add(id(step._step))   # pylint: disable=protected-access
                calls.append(timed(step))
                if fresh:
                    retraced.append(calls[-1])
        except (memsave.NoBottleneckError, ValueError) as e:
            rows.append(dict(model=name, config=label, batch=batch, size=size,
                             error=error_line(e)))
            continue
        once = timed(step)
        steps[label] = step
        row = dict(model=name, config=label, batch=batch, size=size,
                   fell_back=checkpoints is not None and said.fell_back(),
                   build_s=max(0.0, calls[0] - once), peak_mib=peak_memory(step) / MIB)
        if budget:
            # Each replan traces again: its build apart from the first's, and
            # the measured (and once profiled) calls between them left out.
            # The loop's measured calls (the first plan's, the replan's) run
            # before it settles: on a full device, one over the budget fails.
            row.update(budget_mib=budget / MIB, replans=step.loop.replans,
                       calls_mib=[p / MIB for p in step.loop.peaks],
                       replan_build_s=sum(max(0.0, t - once) for t in retraced),
                       loop_said=[l for l in said.lines if l.startswith("memsave: ")
                                  and "budget" in l])
        rows.append(row)
    plain = steps["plain"]
    for row in rows:
        if row["config"] not in steps or row["config"] == "plain":
            continue
        ratios = []
        for i in range(pairs):
            # Plain first in even pairs, second in odd ones: a step run right
            # after another can be slower (the 'plain again' row measured
            # 1.04x with plain always first).
            if i % 2:
                b, a = timed(steps[row["config"]]), timed(plain)
            else:
                a, b = timed(plain), timed(steps[row["config"]])
            ratios.append(b / a)
        row["time_ratio"] = statistics.median(ratios)
        loop = getattr(steps[row["config"]], "loop", None)
        if "budget_mib" in row and loop is not None:
            # The settled plan's calls (the one above, the meter's, the timed
            # ones) are measured too: a call past the margin it was kept
            # under is replanned from (a retrace inside a timed call).
            row.update(drift_replans=loop.drift_replans,
                       settled_calls_max_mib=(loop.settled_peak or 0) / MIB)
    return rows


class _Said(logging.Handler):
    """memsave's log lines while a configuration is traced: did it fall back?"""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())

    def fell_back(self):
        """True when memsave ran plain gradients (its plan was not estimated
        below plain's, or it found nothing to keep)."""
        return any("using plain tf.gradients" in l or "plain tf.GradientTape is used" in l
                   for l in self.lines)


def _run_child(name, quick, pairs, only=None):
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.zoo", "--child", name, "--pairs", str(pairs)]
        + (["--quick"] if quick else []) + (["--configs", only] if only else []),
        capture_output=True, text=True, check=False,
        cwd=pathlib.Path(__file__).resolve().parent.parent)
    lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError("%s failed:\n%s" % (name, out.stderr[-3000:]))
    return json.loads(lines[-1])["rows"]


def _summary(runs):
    """Per (model, config): min/median/max of peaks, median time ratio, build."""
    table = {}
    for rows in runs:
        for row in rows:
            table.setdefault((row["model"], row["config"]), []).append(row)
    out = []
    for (model, config), rows in table.items():
        ok = [r for r in rows if "peak_mib" in r]
        if not ok:
            out.append(dict(model=model, config=config, error=rows[0].get("error"),
                            **{k: rows[0][k] for k in ("batch", "size") if k in rows[0]}))
            continue
        peaks = sorted(r["peak_mib"] for r in ok)
        ratios = [r["time_ratio"] for r in ok if "time_ratio" in r]
        out.append(dict(model=model, config=config, batch=ok[0]["batch"], size=ok[0]["size"],
                        peak_min=peaks[0], peak_median=statistics.median(peaks),
                        peak_max=peaks[-1], processes=len(ok),
                        time_ratio=statistics.median(ratios) if ratios else 1.0,
                        build_s=statistics.median(r["build_s"] for r in ok),
                        replan_build_s=statistics.median(r.get("replan_build_s", 0.0)
                                                         for r in ok),
                        fell_back=any(r.get("fell_back") for r in ok), **_budget_summary(ok)))
    return out


def _budget_summary(rows):
    """A budget row's target (median over processes), replans, and in how many
    processes the peak held (<= the target) and came within 10% below it."""
    if "budget_mib" not in rows[0]:
        return {}
    worst = [max([r["peak_mib"], r.get("settled_calls_max_mib", 0)] + r.get("calls_mib", []))
             for r in rows]
    return dict(budget_mib=statistics.median(r["budget_mib"] for r in rows),
                replans=max(r["replans"] for r in rows),
                drift_replans=max(r.get("drift_replans", 0) for r in rows),
                worst_mib=max(worst),
                held=sum(w <= r["budget_mib"] for w, r in zip(worst, rows)),
                close=sum(0.9 * r["budget_mib"] <= r["peak_mib"] <= r["budget_mib"]
                          for r in rows))


STRATEGIES_SECTION = "Strategies and caps"
BUDGETS_SECTION = "Budgets"


def markdown(summary, machine):
    """The zoo's tables: every configuration but the budgets, then the budgets."""
    lines = ["Model zoo, one training step (float32, memsave.GradientTape in tf.function), "
             "%s. Peak: MiB above the pre-step baseline, min / median / max over processes; "
             "'vs plain': median against plain's median; time: median of alternating pairs "
             "against plain (the 'plain again' row is the noise floor); build: trace, plan "
             "and rewrite, seconds, and against plain's trace (budget rows: the first "
             "trace + the replans' traces); gradients: 'rewritten' (memsave's plan ran) or "
             "'plain (fallback)' (the plan was not estimated below plain's peak, so memsave "
             "ran plain gradients). Budgets: a byte budget, the fraction times plain's "
             "measured peak in the same process, kept by memsave.budgeted (the step is "
             "measured and replanned once; a replan measured over 95%% of the budget is "
             "replanned again on both plans' errors, and one over it too is followed by "
             "the lowest plan; two plans both more than 10%% below it, once more from the "
             "closer); 'target MiB' is the median budget, 'vs target' "
             "the median peak against it, 'worst call' the largest peak of any call the "
             "loop measured (the first plan's and the replan's before it settled, and the "
             "settled plan's later calls; on a full device a call over the budget fails) "
             "against it, 'replans' the most in a process (after a '+', those of a settled "
             "plan whose later call measured past the margin it was kept under), 'held' the "
             "processes where neither the settled peak nor any measured call was above the "
             "target, 'within 10%%' those whose settled peak was also no more than 10%% "
             "below it." % machine, "",
             "**%s**" % STRATEGIES_SECTION, "",
             "| model | config | peak MiB | vs plain | step time vs plain | build s "
             "| build vs plain | gradients |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    plain = {r["model"]: r for r in summary if r["config"] == "plain"}
    budgets = [r for r in summary if r["config"] in BUDGET_ROWS]
    for r in summary:
        if r["config"] in BUDGET_ROWS:
            continue
        if "error" in r:
            lines.append("| %s | %s | raises: %s | | | | | |" % (
                _model_label(r), r["config"], r["error"]))
            continue
        ran = ("plain" if r["config"].startswith("plain") else
               "plain (fallback)" if r.get("fell_back") else "rewritten")
        base = plain[r["model"]]
        lines.append("| %s | %s | %s | %.0f%% | %.2f× | %s | %s |" % (
            _model_label(r), r["config"], _peaks(r),
            100.0 * r["peak_median"] / base["peak_median"], r["time_ratio"],
            _builds(r, base), ran))
    if budgets:
        lines += ["", "**%s**" % BUDGETS_SECTION, "",
                  "| model | config | target MiB | peak MiB | vs target | worst call "
                  "| vs plain | step time vs plain | build s | build vs plain | replans | held "
                  "| within 10% |",
                  "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in budgets:
        if "error" in r:
            lines.append("| %s | %s | raises: %s | | | | | | | | | | |" % (
                _model_label(r), r["config"], r["error"]))
            continue
        base, n = plain[r["model"]], r["processes"]
        lines.append("| %s | %s | %.1f | %s | %.0f%% | %s | %.0f%% | %.2f× | %s | %s | %d/%d "
                     "| %d/%d |" % (
                         _model_label(r), r["config"], r["budget_mib"], _peaks(r),
                         100.0 * r["peak_median"] / r["budget_mib"],
                         "%.0f%%" % (100.0 * r["worst_mib"] / r["budget_mib"])
                         if "worst_mib" in r else "",
                         100.0 * r["peak_median"] / base["peak_median"], r["time_ratio"],
                         _builds(r, base), "%d%s" % (r["replans"], " + %d" % r["drift_replans"]
                                                     if r.get("drift_replans") else ""),
                         r["held"], n, r["close"], n))
    return "\n".join(lines) + "\n"


def _model_label(r):
    if "batch" not in r:
        return model_name(r["model"])
    return "%s (b%d%s)" % (model_name(r["model"]), r["batch"], _size_label(r["model"], r["size"]))


def _peaks(r):
    return "%.1f / %.1f / %.1f" % (r["peak_min"], r["peak_median"], r["peak_max"])


def _builds(r, plain):
    """'build s | build vs plain': a budget's replans after a '+'."""
    trace = max(plain["build_s"], 1e-9)
    build, versus = "%.1f" % r["build_s"], "%.1f×" % (r["build_s"] / trace)
    if r.get("replan_build_s"):
        build += " + %.1f" % r["replan_build_s"]
        versus += " + %.1f×" % (r["replan_build_s"] / trace)
    return "%s | %s" % (build, versus)


def _size_label(model, size):
    if not size:
        return ""
    if model_name(model) not in ("GPT2", "BERT"):
        return ", %dpx" % size
    return ", %d tokens%s" % (size, "" if width(model) == 256 else ", %d wide" % width(model))


def plot(summary, path):
    from benchmarks.plotting import model_panels  # pylint: disable=import-outside-toplevel
    models = list(dict.fromkeys(r["model"] for r in summary))
    fig, axes = model_panels(models, 4, 3.6)
    for ax, model in zip(axes, models):
        rows = [r for r in summary if r["model"] == model and "peak_median" in r]
        plain = next(r["peak_median"] for r in rows if r["config"] == "plain")
        for r in rows:
            ax.errorbar(r["time_ratio"], r["peak_median"] / plain,
                        yerr=[[(r["peak_median"] - r["peak_min"]) / plain],
                              [(r["peak_max"] - r["peak_median"]) / plain]], fmt="o")
            ax.annotate(r["config"], (r["time_ratio"], r["peak_median"] / plain), fontsize=6)
        ax.set_title(model_name(model) + _size_label(model, rows[0]["size"]))
        ax.set_xlabel("step time / plain")
        ax.set_ylabel("peak / plain")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def error_line(error):
    """The message of ``error``, without the traceback tf.function puts before it."""
    lines = [l.strip() for l in str(error).splitlines() if l.strip()]
    named = [l for l in lines if "Error:" in l]
    return "%s: %s" % (type(error).__name__, (named[-1].split("Error:", 1)[1].strip()
                                               if named else lines[-1] if lines else ""))[:300]


def main(argv=None):
    parser = cli.parser(__doc__)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=5, help="alternating timing pairs")
    parser.add_argument("--quick", action="store_true", help="small sizes, one process")
    parser.add_argument("--out", default=str(cli.RESULTS))
    parser.add_argument("--configs", help="only these configurations (labels separated by ';';"
                        " plain is always run)")
    parser.add_argument("--stem", help="results file name (default zoo, or zoo_quick)")
    parser.add_argument("--render", action="store_true",
                        help="rewrite STEM.md and STEM.png from the stored STEM.json (no run)")
    parser.add_argument("--merge", action="store_true",
                        help="replace the models run in the stored STEM.json, keep the others"
                        " (with --configs: only those rows)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps({"rows": child(args.child, args.quick, args.pairs, args.configs)}))
        return 0
    if args.render:
        return _render(pathlib.Path(args.out), args.stem or ("zoo_quick" if args.quick else "zoo"))
    from benchmarks.models import machine_info  # pylint: disable=import-outside-toplevel
    processes = 1 if args.quick else args.processes
    runs = []
    for name in args.models.split(","):
        for i in range(processes):
            print("%s, process %d/%d" % (name, i + 1, processes), file=sys.stderr, flush=True)
            runs.append(_run_child(name, args.quick, args.pairs, args.configs))
    stem = args.stem or ("zoo_quick" if args.quick else "zoo")
    if args.merge:
        runs = _merged(pathlib.Path(args.out) / (stem + ".json"), runs, args.configs)
    summary = _summary(runs)
    machine = machine_info()
    text = markdown(summary, _machine_line(machine))
    out = cli.write(args.out, stem, {"machine": machine, "runs": runs, "summary": summary}, text)
    plot(summary, out / (stem + ".png"))
    print(text)
    return 0


def _machine_line(machine):
    return "CPU (%s, %d cores), TensorFlow %s" % (
        machine["processor"], machine["cpus"], machine["tf_version"])


def _merged(stored, runs, configs=None):
    """The stored run's processes, those of the models in ``runs`` replaced by
    ``runs`` (where the first of them was), in the stored order. With
    ``configs`` (labels separated by ';'), only those rows are replaced (or
    added), process by process; plain's stay (each row's time ratio is
    against the plain of its own process)."""
    if configs:
        return _merged_rows(json.loads(stored.read_text())["runs"], runs, configs.split(";"))
    fresh = {rows[0]["model"] for rows in runs if rows}
    merged, placed = [], False
    for rows in json.loads(stored.read_text())["runs"]:
        if rows and rows[0]["model"] in fresh:
            if not placed:
                merged += runs
                placed = True
            continue
        merged.append(rows)
    return merged if placed else merged + runs


def _merged_rows(stored, runs, labels):
    """``stored`` with the rows of ``labels`` from ``runs`` in place of theirs:
    the n-th fresh process of a model goes into its n-th stored one."""
    fresh = collections.defaultdict(list)
    for rows in runs:
        if rows:
            fresh[rows[0]["model"]].append({r["config"]: r for r in rows
                                            if r["config"] in labels})
    seen = collections.Counter()
    merged = []
    for rows in stored:
        model = rows[0]["model"] if rows else None
        if model not in fresh or seen[model] >= len(fresh[model]):
            merged.append(rows)
            continue
        new = dict(fresh[model][seen[model]])
        seen[model] += 1
        merged.append([new.pop(r["config"], r) for r in rows] + list(new.values()))
    return merged


def _render(out, stem):
    """The table and plot of a stored run, for a change of their layout."""
    data = json.loads((out / (stem + ".json")).read_text())
    text = markdown(data["summary"], _machine_line(data["machine"]))
    (out / (stem + ".md")).write_text(text)
    plot(data["summary"], out / (stem + ".png"))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
