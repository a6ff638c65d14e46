"""Build time against plain's: trace, plan and rewrite of the zoo's training steps.

Run ``python -m benchmarks.build_time`` (``--models DenseNet121,GPT2``,
``--configs "speed;optimal, max_recompute=0.05"``, ``--pairs 3``, ``--quick``
for the zoo's small sizes).
The model zoo (:mod:`benchmarks.zoo`) gives each configuration's build as one
sample, the first call of a step traced after every earlier configuration's
(their functions still alive, so the garbage collector has more to walk),
against plain's first trace in the process (which includes one-time work):
read with its 'plain again' row, a build ratio there is 0.5-2× noise. Here,
in one process per model:

* a plain step is traced and run once first, and discarded (one-time work);
* each build is a fresh ``tf.function`` of the zoo's step, after a full
  garbage collection; ``trace``: ``get_concrete_function()`` (forward
  trace, memsave's plan and rewrite); ``build``: that plus the first call
  less the second (Grappler and kernel creation), what a user waits for;
  the function is dropped after;
* each configuration's builds alternate with plain's in ``--pairs`` pairs
  (plain first in even pairs, second in odd ones); the ratio is the median
  of the pairs' ratios; 'plain again' (plain against plain) is the noise
  floor.

A budget row plans for ``budget`` times plain's estimated peak: the search
a byte budget's trace makes (:mod:`memsave.budget` runs it once per trace,
with a target in bytes; a replan is another such trace). Writes
``benchmarks/results/build_time.{json,md}``.
"""

import argparse
import gc
import json
import pathlib
import statistics
import subprocess
import sys
import time

from benchmarks import cli

cli.environment()

CONFIGS = (
    ("plain again", None, {}),
    ("optimal (default)", "optimal", {}),
    ("memory", "memory", {}),
    ("speed", "speed", {}),
    ("optimal, max_recompute=0.05", "optimal", {"max_recompute": 0.05}),
    ("optimal, max_recompute=0.1", "optimal", {"max_recompute": 0.1}),
    ("budget 0.5 × plain's estimate", "optimal", {"budget": 0.5}),
    ("budget 0.7 × plain's estimate", "optimal", {"budget": 0.7}),
)
MODELS = ("ResNet50", "DenseNet121", "MobileNetV2", "EfficientNetB0", "ConvNeXtTiny", "GPT2",
          "BERT", "GPT2@1024", "BERT@1024")


def child(name, pairs, only=None, quick=False):
    """One model's rows in this process (JSON on stdout)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    tf.config.threading.set_inter_op_parallelism_threads(1)
    from benchmarks import zoo  # pylint: disable=import-outside-toplevel

    batch, size, step_for = zoo.training_steps(name, quick)

    def build(checkpoints, options):
        """(trace s, build s) of a fresh step (the zoo's)."""
        step = step_for(checkpoints, options)
        gc.collect()
        start = time.perf_counter()
        step.get_concrete_function()
        traced = time.perf_counter()
        step()
        first = time.perf_counter()
        step()
        second = time.perf_counter()
        return traced - start, (first - start) - (second - first)

    build(None, {})   # one-time work of the first trace in the process
    rows = []
    for label, checkpoints, options in CONFIGS:
        if only and label not in only.split(";"):
            continue
        pairs_run = []
        for i in range(pairs):
            if i % 2:
                mine, plain = build(checkpoints, options), build(None, {})
            else:
                plain, mine = build(None, {}), build(checkpoints, options)
            pairs_run.append(dict(plain_trace_s=plain[0], plain_build_s=plain[1],
                                  trace_s=mine[0], build_s=mine[1]))
        rows.append(dict(model=name, config=label, batch=batch, size=size, pairs=pairs_run,
                         trace_ratio=statistics.median(p["trace_s"] / p["plain_trace_s"]
                                                       for p in pairs_run),
                         build_ratio=statistics.median(p["build_s"] / p["plain_build_s"]
                                                       for p in pairs_run)))
    return rows


def markdown(rows, machine):
    """The table: per model and configuration, median seconds and median ratios."""
    from benchmarks.zoo import _model_label  # pylint: disable=import-outside-toplevel
    lines = ["Build time against plain's, one training step of the model zoo (float32, "
             "memsave.GradientTape in tf.function), %s. Each build is a fresh function "
             "after a full garbage collection, alternating with plain's in pairs; 'trace': "
             "forward trace, plan and rewrite (`get_concrete_function`); 'build': that plus "
             "the first call less the second (Grappler, kernels); seconds are medians over "
             "the pairs, ratios the median of the pairs' ratios; 'plain again' is the noise "
             "floor." % machine, "",
             "| model | config | pairs | plain trace s | trace s | trace vs plain "
             "| plain build s | build s | build vs plain |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        med = {k: statistics.median(p[k] for p in r["pairs"]) for k in r["pairs"][0]}
        lines.append("| %s | %s | %d | %.1f | %.1f | %.2f× | %.1f | %.1f | %.2f× |" % (
            _model_label(r), r["config"], len(r["pairs"]), med["plain_trace_s"],
            med["trace_s"], r["trace_ratio"], med["plain_build_s"], med["build_s"],
            r["build_ratio"]))
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = cli.parser(__doc__)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--pairs", type=int, default=3, help="alternating pairs per config")
    parser.add_argument("--configs", help="only these configurations (labels separated by ';')")
    parser.add_argument("--quick", action="store_true", help="the zoo's small sizes")
    parser.add_argument("--stem", default="build_time", help="results file name")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = cli.parse(parser, argv)
    if args.child:
        print(json.dumps(dict(rows=child(args.child, args.pairs, args.configs, args.quick))))
        return
    from benchmarks.models import machine_info  # pylint: disable=import-outside-toplevel
    from benchmarks.zoo import _machine_line  # pylint: disable=import-outside-toplevel
    start, rows = time.time(), []
    for name in args.models.split(","):
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.build_time", "--child", name,
             "--pairs", str(args.pairs)] + (["--configs", args.configs] if args.configs else [])
            + (["--quick"] if args.quick else []),
            capture_output=True, text=True, check=False,
            cwd=pathlib.Path(__file__).resolve().parent.parent)
        lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
        if out.returncode or not lines:
            raise RuntimeError("%s failed:\n%s" % (name, out.stderr[-3000:]))
        rows += json.loads(lines[-1])["rows"]
        print("%s done (%.0f s)" % (name, time.time() - start), flush=True)
    machine = machine_info()
    table = markdown(rows, _machine_line(machine))
    cli.write(args.out, args.stem, dict(machine=machine, rows=rows,
                                        meta=dict(seconds=time.time() - start)), table)
    cli.report(dict(markdown=table, meta=dict(seconds=time.time() - start)), args.stem,
               args.out)


if __name__ == "__main__":
    main()
