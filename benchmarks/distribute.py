"""Per-worker peak memory and step time of memsave under MultiWorkerMirroredStrategy.

Run ``python -m benchmarks.distribute`` (about 5 minutes on 2 cores). Each
run launches ``examples/multi_worker.py``: two local worker processes
(127.0.0.1, ``TF_CONFIG``), each training the ResNet of
``benchmarks/models.py`` with a custom loop (``strategy.run``, all-reduce of
the gradients, SGD by ``assign_sub``), plain ``tf.GradientTape`` and
``memsave.GradientTape(checkpoints='optimal')`` from the same weights. Each
worker measures its own peak (allocator peak above the pre-step baseline,
BFC, one inter-op thread) and step time (median over alternating steps).

Plain's peak is not fixed from process to process (its schedule is free),
so every configuration runs ``--runs`` times (fresh processes each time)
and the table gives min / median / max over all workers of all runs.
Writes ``benchmarks/results/distribute.{json,md}``.
"""

import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "multi_worker.py"


def run_example(batch, workers, steps, tiny=False, timeout=600):
    """One launch of the example; its JSON (workers' results and wall time)."""
    with tempfile.TemporaryDirectory(prefix="memsave_distribute_") as tmp:
        out = pathlib.Path(tmp) / "run.json"
        argv = [sys.executable, str(EXAMPLE), "--workers", str(workers), "--steps", str(steps),
                "--json", str(out), "--timeout", str(timeout)]
        argv += ["--tiny"] if tiny else ["--batch", str(batch)]
        # The example kills its workers itself; it runs in its own session so
        # that nothing it started can outlive a timeout here either.
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE,  # pylint: disable=consider-using-with
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            stdout, _ = proc.communicate(timeout=timeout + 60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
        if proc.returncode != 0:
            raise RuntimeError("examples/multi_worker.py failed:\n" + stdout[-3000:])
        return json.loads(out.read_text())


def _spread(values):
    return dict(min=min(values), median=statistics.median(values), max=max(values))


def summarize(runs):
    workers = [w for run in runs for w in run["workers"]]
    first = workers[0]
    return dict(
        sizes=first["sizes"], activation_mib=first["activation_mib"],
        runs=len(runs), workers_per_run=len(runs[0]["workers"]),
        plain_peak_mib=_spread([w["plain_peak_mib"] for w in workers]),
        memsave_peak_mib=_spread([w["memsave_peak_mib"] for w in workers]),
        saving=_spread([w["saving"] for w in workers]),
        plain_step_s=_spread([w["plain_step_s"] for w in workers]),
        memsave_step_s=_spread([w["memsave_step_s"] for w in workers]),
        step_time_ratio=_spread([w["step_time_ratio"] for w in workers]),
        weight_rel_diff_max=max(w["weight_rel_diff"] for w in workers),
        workers_agree=all(len({w["plain_digest"] for w in run["workers"]}) == 1
                          and len({w["memsave_digest"] for w in run["workers"]}) == 1
                          for run in runs),
        wall_s=_spread([run["wall_s"] for run in runs]),
        per_worker=[dict(run=i, task=w["task"], plain_peak_mib=round(w["plain_peak_mib"], 2),
                         memsave_peak_mib=round(w["memsave_peak_mib"], 2),
                         step_time_ratio=round(w["step_time_ratio"], 3))
                    for i, run in enumerate(runs) for w in run["workers"]])


def _mmm(spread, fmt="%.1f"):
    return " / ".join(fmt % spread[k] for k in ("min", "median", "max"))


def markdown(result):
    lines = ["Two local MultiWorkerMirroredStrategy workers, ResNet of benchmarks/models.py "
             "(%s); per-worker figures, min / median / max over %d runs x %d workers." % (
                 ", ".join("%s=%s" % kv for kv in result["configs"][0]["sizes"].items()
                           if kv[0] != "batch"),
                 result["configs"][0]["runs"], result["configs"][0]["workers_per_run"]),
             "",
             "| examples per worker | one activation | plain peak MiB | memsave peak MiB "
             "| saving | step-time ratio | weights vs plain | example wall s |",
             "|---:|---:|---|---|---|---|---:|---|"]
    for c in result["configs"]:
        lines.append("| %d | %.2f MiB | %s | %s | %s | %s | %.1e | %s |" % (
            c["sizes"]["batch"], c["activation_mib"], _mmm(c["plain_peak_mib"]),
            _mmm(c["memsave_peak_mib"]),
            " / ".join("%.0f%%" % (100 * c["saving"][k]) for k in ("min", "median", "max")),
            _mmm(c["step_time_ratio"], "%.2f×"), c["weight_rel_diff_max"],
            _mmm(c["wall_s"], "%.0f")))
    meta = result["meta"]
    lines += ["", "Peak: allocator peak above the pre-step baseline in each worker (BFC, one "
              "inter-op thread, %d intra-op thread per worker); step-time ratio: memsave / "
              "plain, median over %d alternating steps; weights: max |plain - memsave| / "
              "max |plain| after %d steps; every worker ended with the same weights: %s. "
              "CPU (%s, %d cores), TensorFlow %s." % (
                  meta["threads"], meta["steps"], meta["steps"] + 2,
                  "yes" if all(c["workers_agree"] for c in result["configs"]) else "NO",
                  meta["processor"], meta["cpus"], meta["tf_version"])]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = cli.parser(__doc__)
    parser.add_argument("--runs", type=int, default=3, help="launches per configuration")
    parser.add_argument("--batches", type=int, nargs="*", default=[16, 8],
                        help="examples per worker (8 is benchmarks/models.py's full size)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per method")
    parser.add_argument("--tiny", action="store_true", help="tiny ResNet, one run (tests)")
    args = cli.parse(parser, argv)
    start = time.perf_counter()
    from benchmarks.models import machine_info  # pylint: disable=import-outside-toplevel
    meta = machine_info()
    meta.update(workers=args.workers, steps=args.steps,
                threads=max(1, (os.cpu_count() or 1) // args.workers))
    configs = []
    for batch in ([None] if args.tiny else args.batches):
        runs = []
        for i in range(1 if args.tiny else args.runs):
            run = run_example(batch, args.workers, args.steps, tiny=args.tiny)
            runs.append(run)
            print("batch %s run %d: %s  (%.0f s)" % (
                batch or "tiny", i, ", ".join(
                    "worker %d plain %.1f / memsave %.1f MiB, time x%.2f" % (
                        w["task"], w["plain_peak_mib"], w["memsave_peak_mib"],
                        w["step_time_ratio"]) for w in run["workers"]),
                run["wall_s"]), file=sys.stderr)
        configs.append(summarize(runs))
    meta["seconds"] = round(time.perf_counter() - start, 1)
    meta["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    result = dict(meta=meta, configs=configs)
    table = markdown(result)
    out = cli.write(args.out, "distribute", result, table)
    print(table)
    print("wrote distribute.{json,md} in %s (%.0f s)" % (out, meta["seconds"]))
    return result


if __name__ == "__main__":
    main()
