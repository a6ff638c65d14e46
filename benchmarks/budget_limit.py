"""A budget under a hard memory limit: plain runs out of memory, memsave trains.

``python -m benchmarks.budget_limit`` (``--quick`` for small sizes,
``--fraction 0.8`` the cap above the baseline as a fraction of plain's
step peak). For each model, three fresh processes:

1. uncapped: the allocator's baseline before the first step (weights, data)
   and plain's step peak above it (``memsave.profile``), and plain's
   gradients of the first step;
2. capped with ``TF_CPU_BFC_MEM_LIMIT_IN_MB`` = baseline + fraction x
   plain's peak (the allocator refuses past it, as a full GPU does): plain
   training steps (``tf.GradientTape``, SGD update);
3. the same cap, ``memsave.GradientTape(budget=...)``, the budget
   :data:`HEADROOM` of what the cap leaves above the baseline, in a step
   wrapped by :func:`memsave.budgeted`: its first gradients are compared with plain's
   (relative to the largest entry of all gradients), and the measured peak
   (of a call once the loop has settled) and replans are reported.

Writes ``benchmarks/results/budget_limit.{json,md}``.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

from benchmarks import cli

MIB = 2 ** 20
# GPT2 and BERT (4 layers, 128 tokens; benchmarks.zoo builds them). The
# applications' float32 gradients are ill-conditioned at small sizes (with
# oneDNN, MobileNetV2's first depthwise kernel at batch 8, 64 px: plain's
# own float32 gradient is 1.3e-2 of the largest entry from float64's), too
# loose a check for "plain's gradients"; --models MobileNetV2 runs one.
SIZES = {"GPT2": (8, None), "BERT": (8, None), "MobileNetV2": (16, 128)}
QUICK_SIZES = {"GPT2": (4, None), "BERT": (4, None), "MobileNetV2": (8, 64)}
MODELS = ("GPT2", "BERT")
STEPS = 9   # enough for the loop to measure three calls, replan once and measure three again
SETTLING_CALLS = 16   # more calls, for a loop that replans again, until it settles
# The budget memsave is given: this share of what the cap leaves above the
# baseline. The cap limits the allocator's pool, the budget the bytes in use;
# BFC's chunks and bins waste a fifth to a third of a capped pool (MobileNetV2
# ran out of memory under a cap 21% above the bytes it had in use; BERT's
# budgeted step, replanned to about 37 MiB in use with 75% of the cap as its
# budget, ran out of memory in one run of two).
HEADROOM = 0.65


def _step(model, x, y, loss_fn, budget=None, learning_rate=1e-3):
    """One SGD training step (a tf.function) returning the loss and gradients."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import memsave  # pylint: disable=import-outside-toplevel
    inputs = [tf.constant(a) for a in x] if isinstance(x, list) else tf.constant(x)
    labels, weights = tf.constant(y), model.trainable_variables

    @tf.function
    def step():
        tape = (tf.GradientTape() if budget is None
                else memsave.GradientTape(checkpoints="optimal", budget=budget))
        with tape:
            loss = loss_fn(labels, model(inputs, training=True))
        # Dense gradients (BERT's embedding gives IndexedSlices), for the update
        # and the comparison.
        grads = [None if g is None else tf.convert_to_tensor(g)
                 for g in tape.gradient(loss, weights)]
        for w, g in zip(weights, grads):
            if g is not None:
                w.assign_sub(learning_rate * g)
        return loss, grads
    return step


def child(name, quick, mode, budget, grads_path):
    """One process: 'measure' (uncapped), 'plain' or 'memsave' (under the cap)."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import memsave  # pylint: disable=import-outside-toplevel
    from memsave.profile import memory_info, peak_memory  # pylint: disable=C0415
    from benchmarks.zoo import _build  # pylint: disable=import-outside-toplevel
    batch, size = (QUICK_SIZES if quick else SIZES)[name]
    model, x, y, loss_fn = _build(name, batch, size)
    if mode == "measure":
        step = _step(model, x, y, loss_fn, learning_rate=0.0)
        baseline = memory_info("CPU:0")["current"]
        _, grads = step()
        np.savez(grads_path, *[g.numpy() for g in grads if g is not None])
        return dict(baseline=baseline, plain_peak=peak_memory(step))
    step = _step(model, x, y, loss_fn, budget=budget if mode == "memsave" else None)
    if mode == "memsave":
        step = memsave.budgeted(step)
    try:
        first = [g.numpy() for g in step()[1] if g is not None]
        for _ in range(STEPS - 1):
            loss = step()[0]   # the gradients are dropped: only the weights stay
        # A loop that replanned more than once is still measuring a plan on
        # trial (whose call over the budget a full device refuses, and memsave
        # runs again on a lower plan): trained on until it settles, so the
        # peak below is the settled plan's.
        for _ in range(SETTLING_CALLS):
            if mode != "memsave" or step.loop.done:
                break
            loss = step()[0]
    except tf.errors.ResourceExhaustedError:
        return dict(outcome="out of memory")
    plain = np.load(grads_path)
    plain = [plain["arr_%d" % i] for i in range(len(plain.files))]
    scale = max(float(np.abs(g).max()) for g in plain)
    error = max(float(np.abs(a - b).max()) for a, b in zip(plain, first)) / scale
    out = dict(outcome="trained", loss=float(loss), gradient_error=error)
    if mode == "memsave":
        out.update(peak=peak_memory(step), replans=step.loop.replans, peaks=step.loop.peaks,
                   first_measured=step.loop.first[1] if step.loop.first else None)
    return out


def _run_child(name, quick, mode, budget, grads_path, limit_mib=None):
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("TF_CPU_BFC_MEM_LIMIT_IN_MB", None)
    if limit_mib is not None:
        env["TF_CPU_BFC_MEM_LIMIT_IN_MB"] = str(limit_mib)
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.budget_limit", "--child", name, "--mode", mode,
         "--budget", str(budget or 0), "--grads", grads_path] + (["--quick"] if quick else []),
        capture_output=True, text=True, check=False, env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
    if lines:
        return json.loads(lines[-1])
    if out.returncode < 0:   # some kernels abort instead of raising when an allocation fails
        return dict(outcome="out of memory (the process died: signal %d)" % -out.returncode)
    return dict(outcome="failed (exit %d): %s" % (out.returncode, out.stderr.strip()[-500:]))


def measure(name, quick, fraction):
    """The three processes of one model (see the module docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        grads = os.path.join(tmp, "plain.npz")
        first = _run_child(name, quick, "measure", None, grads)
        if "plain_peak" not in first:
            raise RuntimeError("%s: %s" % (name, first["outcome"]))
        limit = math.ceil((first["baseline"] + fraction * first["plain_peak"]) / MIB)
        budget = int(HEADROOM * (limit * MIB - first["baseline"]))
        plain = _run_child(name, quick, "plain", None, grads, limit)
        ours = _run_child(name, quick, "memsave", budget, grads, limit)
    return dict(model=name, size=(QUICK_SIZES if quick else SIZES)[name], fraction=fraction,
                baseline=first["baseline"], plain_peak=first["plain_peak"], budget=budget,
                limit_mib=limit, plain=plain, memsave=ours)


def markdown(rows, machine):
    lines = ["Under a hard limit (%s): `TF_CPU_BFC_MEM_LIMIT_IN_MB` = the baseline before "
             "the step + %.0f%% of plain's uncapped step peak; memsave's budget: %.0f%% of "
             "what the limit leaves above the baseline (the rest is the allocator's "
             "fragmentation); "
             "%d SGD steps per process; gradient error: the first step's against plain's "
             "uncapped, relative to the largest entry of all gradients." % (
                 machine, 100 * rows[0]["fraction"], 100 * HEADROOM, STEPS), "",
             "| model | plain peak MiB | budget MiB | limit MiB | plain | memsave | memsave "
             "peak MiB | replans | gradient error |",
             "|---|---:|---:|---:|---|---|---:|---:|---:|"]
    for r in rows:
        ours = r["memsave"]
        lines.append("| %s (b%d%s) | %.1f | %.1f | %d | %s | %s | %s | %s | %s |" % (
            r["model"], r["size"][0], ", %dpx" % r["size"][1] if r["size"][1] else "",
            r["plain_peak"] / MIB, r["budget"] / MIB, r["limit_mib"], r["plain"]["outcome"],
            ours["outcome"], "%.1f" % (ours["peak"] / MIB) if "peak" in ours else "",
            ours.get("replans", ""),
            "%.1e" % ours["gradient_error"] if "gradient_error" in ours else ""))
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = cli.parser(__doc__)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--fraction", type=float, default=0.8)
    parser.add_argument("--quick", action="store_true", help="small sizes")
    for name in ("--child", "--mode", "--budget", "--grads"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    args = cli.parse(parser, argv)
    if args.child:
        cli.environment()
        print(json.dumps(child(args.child, args.quick, args.mode, int(args.budget), args.grads)))
        return 0
    from benchmarks.models import machine_info  # pylint: disable=import-outside-toplevel
    rows = [measure(name, args.quick, args.fraction) for name in args.models.split(",")]
    machine = machine_info()
    text = markdown(rows, "CPU (%s, %d cores), TensorFlow %s" % (
        machine["processor"], machine["cpus"], machine["tf_version"]))
    cli.write(args.out, "budget_limit_quick" if args.quick else "budget_limit",
              {"machine": machine, "rows": rows}, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
