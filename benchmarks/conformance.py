"""The conformance suite's models, one row per model and strategy.

Run ``python -m benchmarks.conformance`` (about 15 minutes on 2 cores).
For each model of ``tests/test_real_models.py`` (same builders, same
sizes: 32x32 images, batch 2, float64), in a child process per model:
``memsave.GradientTape`` with each strategy (``fallback=False``: at these
sizes most plans are estimated within 10% of plain's, where memsave would
run plain gradients) beside the plain tape in one ``tf.function``, on one
forward pass, and

* the gradient difference, max |plain - memsave| over the largest plain
  entry, and whether the ``None`` pattern and the gradient kinds
  (``IndexedSlices``) match;
* the peak of a step computing that strategy's gradients alone
  (memsave.profile.peak_memory: allocator peak above the pre-step baseline,
  BFC allocator, one inter-op thread, CPU), next to plain's in the same
  process.

The peaks are one process each, at tiny sizes where weights and their
gradients dominate: they show that nothing breaks, not how much memory a
strategy saves (that is the model-zoo benchmark's job). Writes
``benchmarks/results/conformance.{json,md}``.
"""

import argparse
import json
import subprocess
import sys

from benchmarks import cli

cli.environment()

STRATEGIES = ("optimal", "memory", "speed", "collection")
MIB = 2 ** 20


def measure(name):
    """One model's rows (runs in a child process: one allocator per model)."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import memsave  # pylint: disable=import-outside-toplevel
    from memsave.profile import peak_memory  # pylint: disable=import-outside-toplevel
    from benchmarks.zoo_models import build  # pylint: disable=import-outside-toplevel

    model, x, y, loss_fn = build(name, 2)
    inputs = [tf.constant(a) for a in x] if isinstance(x, list) else tf.constant(x)
    weights = model.trainable_variables

    def tape_for(strategy):
        return tf.GradientTape() if strategy == "plain" else memsave.GradientTape(
            checkpoints=strategy, fallback=False)

    def step_for(strategy):
        @tf.function
        def step():
            with tape_for(strategy) as tape:
                loss = loss_fn(y, model(inputs, training=True))
            return [g for g in tape.gradient(loss, weights) if g is not None]
        return step

    def all_gradients():
        refused, kinds = {}, {}

        @tf.function
        def step():
            tapes = {s: tape_for(s) for s in ("plain",) + STRATEGIES}
            for tape in tapes.values():
                tape.__enter__()
            loss = loss_fn(y, model(inputs, training=True))
            for tape in reversed(list(tapes.values())):
                tape.__exit__(None, None, None)
            out = {}
            for key, tape in tapes.items():
                try:
                    raw = tape.gradient(loss, weights)
                except memsave.NoBottleneckError as e:
                    refused[key] = str(e).split(".")[0]
                    continue
                kinds[key] = [type(g).__name__ for g in raw]
                out[key] = [None if g is None else tf.convert_to_tensor(g) for g in raw]
            return out
        grads = {k: [None if g is None else g.numpy() for g in v] for k, v in step().items()}
        return grads, refused, kinds

    grads, refused, kinds = all_gradients()
    plain = grads["plain"]
    scale = max(float(np.abs(g).max()) for g in plain if g is not None)
    plain_peak = peak_memory(step_for("plain"))
    rows = [dict(model=name, strategy="plain", peak_mib=plain_peak / MIB, rel_diff=0.0,
                 same_none=True, same_kinds=True, result="reference")]
    for strategy in STRATEGIES:
        row = dict(model=name, strategy=strategy)
        if strategy in refused:
            row.update(result="NoBottleneckError: " + refused[strategy])
            rows.append(row)
            continue
        ours = grads[strategy]
        same_none = [g is None for g in plain] == [g is None for g in ours]
        diff = max(float(np.abs(a - b).max()) for a, b in zip(plain, ours)
                   if a is not None and b is not None)
        row.update(peak_mib=peak_memory(step_for(strategy)) / MIB, rel_diff=diff / scale,
                   same_none=same_none, same_kinds=kinds[strategy] == kinds["plain"])
        ok = same_none and row["same_kinds"] and row["rel_diff"] <= 1e-7
        row["result"] = "pass" if ok else "FAIL"
        rows.append(row)
    return rows


def markdown(rows):
    lines = ["| model | strategy | peak MiB (plain's in the same process) | max diff / largest "
             "entry | None pattern, kinds | result |", "|---|---|---|---|---|---|"]
    plain = {r["model"]: r["peak_mib"] for r in rows if r["strategy"] == "plain"}
    for r in rows:
        if r["strategy"] == "plain":
            continue
        if "peak_mib" not in r:
            lines.append("| %s | %s | | | | %s |" % (r["model"], r["strategy"], r["result"]))
            continue
        lines.append("| %s | %s | %.1f (%.1f) | %.1e | %s | %s |" % (
            r["model"], r["strategy"], r["peak_mib"], plain[r["model"]], r["rel_diff"],
            "same" if r["same_none"] and r["same_kinds"] else "DIFFERENT", r["result"]))
    return "\n".join(lines) + "\n"


def main():
    from benchmarks.zoo_models import MODELS  # pylint: disable=import-outside-toplevel
    parser = cli.parser(__doc__)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        sys.stdout.write("\n" + json.dumps(measure(args.child)) + "\n")
        return
    rows = []
    for name in args.models.split(","):
        out = subprocess.run([sys.executable, "-m", "benchmarks.conformance", "--child", name],
                             check=True, capture_output=True, text=True).stdout
        rows.extend(json.loads(out.strip().splitlines()[-1]))
        print(markdown([r for r in rows if r["model"] == name]), flush=True)
    cli.write(cli.RESULTS, "conformance", rows, markdown(rows))


if __name__ == "__main__":
    main()
