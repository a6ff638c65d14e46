"""Time to choose checkpoints on large synthetic planning graphs.

``python -m benchmarks.plan_speed`` builds framework-free planning graphs
(a residual chain and a U-Net-like DAG with long skips) of about 1k, 5k and
20k tensors and times the 'memory' and 'optimal' strategies on each, and
'optimal' under a budget and under a recompute cap.
Writes ``benchmarks/results/plan_speed.{json,md}``.
"""

import json
import pathlib
import time

import numpy as np

from benchmarks import cli
from memsave.planning import PlanGraph, memory, optimal

MB = 2**20


def _node(g, name, order, size=MB, x=False, y=False, op_type="Tanh"):
    g.add_tensor(name, order=order, elements=size // 4, bytes=0 if x else size,
                 cost=float(size), op_type=op_type, x=x, y=y, candidate=not (x or y))


def residual(n_tensors, rng):
    """Blocks of 4 tensors with a skip around 3 of them."""
    g = PlanGraph()
    _node(g, "x", -1, x=True)
    prev, i = "x", 0
    while i < n_tensors - 1:
        a, b, c, d = ("t%d" % (i + k) for k in range(4))
        for k, name in enumerate((a, b, c, d)):
            _node(g, name, i + k, size=int(MB * rng.uniform(0.5, 1.5)))
        g.add_edges_from([(prev, a), (a, b), (b, c), (prev, d), (c, d)])
        prev, i = d, i + 4
    _node(g, "y", i, y=True)
    g.add_edge(prev, "y")
    return g


def unet_like(n_tensors, rng):
    """A chain with nested long skips (every level skips over the next)."""
    g = PlanGraph()
    _node(g, "x", -1, x=True)
    names = ["t%d" % i for i in range(n_tensors)]
    for i, name in enumerate(names):
        _node(g, name, i, size=int(MB * rng.uniform(0.5, 1.5)))
        g.add_edge(names[i - 1] if i else "x", name)
    half = n_tensors // 2
    for level in range(1, 8):
        span = max(4, half >> level)
        for start in range(0, n_tensors - 2 * span, 2 * span):
            g.add_edge(names[start], names[min(n_tensors - 1, start + 2 * span)])
    _node(g, "y", n_tensors, y=True)
    g.add_edge(names[-1], "y")
    return g


# The default plans, and those under a budget (half of plain's estimate) or a
# cap (5% of a step's work), which simulate many more candidates.
STRATEGIES = (("memory", memory), ("optimal", optimal),
              ("optimal, budget 0.5", lambda g: optimal(g, budget=0.5)),
              ("optimal, max_recompute 0.05", lambda g: optimal(g, max_recompute=0.05)))


def main(argv=None):
    parser = cli.parser(__doc__)
    parser.add_argument("--sizes", type=int, nargs="*", default=[1000, 5000, 20000])
    args = cli.parse(parser, argv)
    rng = np.random.RandomState(0)
    rows = []
    for size in args.sizes:
        for kind, make in (("residual", residual), ("unet-like", unet_like)):
            graph = make(size, rng)
            for name, strategy in STRATEGIES:
                start = time.perf_counter()
                try:
                    plan = strategy(graph)
                    kept = len(plan.checkpoints)
                except ValueError:
                    kept = None
                seconds = time.perf_counter() - start
                rows.append(dict(graph=kind, tensors=graph.number_of_nodes(), strategy=name,
                                 seconds=round(seconds, 3), checkpoints=kept))
                print("%-9s %6d tensors  %-7s %7.3f s  %s checkpoints" % (
                    kind, graph.number_of_nodes(), name, seconds, kept))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan_speed.json").write_text(json.dumps(rows, indent=1))
    five_k = [r["seconds"] for r in rows if r["strategy"] == "optimal" and 4000 <= r["tensors"] <= 6000]
    if five_k:
        verdict = "PASS" if max(five_k) < 2.0 else "FAIL"
        print("%s: 'optimal' selects in %.2f s at ~5,000 tensors (target < 2 s)"
              % (verdict, max(five_k)))
    lines = ["| graph | tensors | strategy | seconds | checkpoints |", "|---|---|---|---|---|"]
    lines += ["| %s | %d | %s | %.3f | %s |" % (r["graph"], r["tensors"], r["strategy"],
                                                r["seconds"], r["checkpoints"]) for r in rows]
    (out / "plan_speed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
