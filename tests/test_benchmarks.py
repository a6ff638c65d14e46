"""Every benchmark runs end to end at a tiny size, so none can rot."""

import json
import subprocess
import sys

import pytest


def _run(args, tmp_path):
    out = subprocess.run([sys.executable, "-m"] + args + ["--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.heavy
def test_depth_benchmark_tiny(tmp_path):
    stdout = _run(["benchmarks.depth", "--depths", "4", "8", "--repeats", "1", "--stem", "t"],
                  tmp_path)
    data = json.loads((tmp_path / "t.json").read_text())
    methods = {r["method"] for r in data["rows"]}
    assert {"plain", "memory", "optimal", "speed", "grappler", "tf.recompute_grad"} <= methods
    assert data["meta"]["tf_version"]
    assert (tmp_path / "t.png").stat().st_size > 10_000
    assert (tmp_path / "t_time.png").stat().st_size > 10_000
    assert "| depth |" in stdout
    for row in data["rows"]:
        assert row["peak_activations"] > 0


def test_plan_speed_benchmark_tiny(tmp_path):
    _run(["benchmarks.plan_speed", "--sizes", "200"], tmp_path)
    rows = json.loads((tmp_path / "plan_speed.json").read_text())
    assert {r["strategy"] for r in rows} == {
        "memory", "optimal", "optimal, budget 0.5", "optimal, max_recompute 0.05"}
    assert all(r["checkpoints"] for r in rows if r["strategy"] != "memory")


def test_op_rates_benchmark_quick(tmp_path):
    _run(["benchmarks.op_rates", "--quick"], tmp_path)
    data = json.loads((tmp_path / "op_rates_quick.json").read_text())
    rows = {r["op"]: r for r in data["rows"]}
    assert rows["conv 3x3"]["measured_over_modeled"] == pytest.approx(1.0)
    assert {"softmax (last axis)", "batch-norm moments (mean, squared difference, mean)"} <= set(rows)
    assert all(r["modeled"] > 0 and r["seconds"] > 0 for r in rows.values())
    models = {m["model"]: m for m in data["models"]}
    assert set(models) == {"MobileNetV2", "GPT2"}
    assert models["GPT2"]["parts"]["softmax_bytes"] > 0 < models["MobileNetV2"]["parts"]["flops"]
    assert all(m["seconds"] > 0 and m["work_per_second"] > 0 for m in models.values())
    assert data["fitted"]["other"] is None or data["fitted"]["other"] >= 0
    text = (tmp_path / "op_rates_quick.md").read_text()
    assert "| op |" in text and "| model |" in text


@pytest.mark.slow   # 30 s; test_optimal measures the same U-Nets
@pytest.mark.parametrize("script", ["examples/unet.py"])
def test_examples_run(script):
    out = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| 'optimal' |" in out.stdout


@pytest.mark.heavy   # three processes, about 20 s
def test_fit_in_budget_example_trains_where_plain_runs_out_of_memory():
    """examples/fit_in_budget.py: under the same allocator cap plain fit runs out
    of memory and memsave with budget= trains, to plain's uncapped loss."""
    sys.path.insert(0, "examples")
    try:
        import fit_in_budget   # pylint: disable=import-outside-toplevel
    finally:
        sys.path.remove("examples")
    capped = fit_in_budget.run(fit_in_budget.LIMIT_MB, None)
    ours = fit_in_budget.run(fit_in_budget.LIMIT_MB, fit_in_budget.BUDGET)
    plain = fit_in_budget.run(None, None)
    assert capped.startswith("OUT OF MEMORY"), capped
    assert ours.startswith("trained") and plain.startswith("trained"), (ours, plain)
    assert float(ours.split()[-1]) == pytest.approx(float(plain.split()[-1]), rel=1e-4)


@pytest.mark.slow   # about two minutes: a keras-hub GPT2 traced for each configuration
def test_zoo_benchmark_quick(tmp_path):
    stdout = _run(["benchmarks.zoo", "--quick", "--models", "GPT2", "--pairs", "1"], tmp_path)
    data = json.loads((tmp_path / "zoo_quick.json").read_text())
    configs = {r["config"] for r in data["summary"]}
    assert {"plain", "plain again", "optimal (default)", "budget 0.7 × plain",
            "optimal, max_recompute=0.1"} <= configs
    for row in data["summary"]:
        assert row.get("error") or row["peak_median"] > 0
    rows = {r["config"]: r for r in data["summary"]}
    # Which rows ran memsave's rewrite is read from memsave's own log: the
    # default rewrites GPT2, and so does a cap of 10% of a training step
    # (what plain keeps less the GELUs' intermediates, recomputed).
    assert not rows["plain"]["fell_back"] and not rows["optimal (default)"]["fell_back"]
    assert not rows["optimal, max_recompute=0.1"]["fell_back"]
    # A byte budget, 0.7 x plain's measured peak, kept on the allocator.
    kept = rows["budget 0.7 × plain"]
    # At most three replans: one, a second between or below two plans
    # measured over, then the lowest plan (memsave.budget's Loop).
    assert kept["held"] == 1 and kept["replans"] <= 3
    assert kept["peak_median"] <= kept["worst_mib"] <= kept["budget_mib"]
    assert (tmp_path / "zoo_quick.png").stat().st_size > 10_000
    assert "| GPT2" in stdout
    assert "| rewritten |" in stdout
    assert ("| plain (fallback) |" in stdout) == any(r.get("fell_back") for r in rows.values())


@pytest.mark.slow   # about a minute: a small keras-hub GPT2 traced eight times
def test_build_time_benchmark_quick(tmp_path):
    stdout = _run(["benchmarks.build_time", "--quick", "--models", "GPT2", "--pairs", "2",
                   "--configs", "plain again;optimal (default)"], tmp_path)
    rows = json.loads((tmp_path / "build_time.json").read_text())["rows"]
    assert [r["config"] for r in rows] == ["plain again", "optimal (default)"]
    for row in rows:
        assert len(row["pairs"]) == 2
        for p in row["pairs"]:
            assert min(p.values()) > 0
        assert row["build_ratio"] > 0 and row["trace_ratio"] > 0
    assert "| GPT2 (b2) | optimal (default) | 2 |" in stdout


def test_zoo_render_rewrites_the_table_from_the_stored_run(tmp_path):
    from benchmarks import zoo  # pylint: disable=import-outside-toplevel
    row = dict(model="GPT2", batch=2, size=64, peak_min=10.0, peak_median=10.0, peak_max=10.0,
               processes=1, time_ratio=1.0, build_s=2.0, fell_back=False)
    summary = [dict(row, config="plain"),
               dict(row, config="optimal (default)", peak_min=4.0, peak_median=4.0, peak_max=4.0,
                    time_ratio=1.2, build_s=3.0),
               dict(model="GPT2", config="budget 0.3 × plain", error="BudgetError: no plan"),
               dict(row, config="budget 0.5 × plain", peak_min=4.6, peak_median=4.6, peak_max=4.6,
                    time_ratio=1.1, build_s=3.0, replan_build_s=2.5, budget_mib=5.0,
                    replans=1, held=1, close=1, worst_mib=4.9)]
    machine = dict(processor="x", cpus=2, tf_version="2.21.0")
    (tmp_path / "zoo.json").write_text(json.dumps({"machine": machine, "runs": [],
                                                   "summary": summary}))
    assert zoo.main(["--render", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "zoo.md").read_text()
    assert "| build vs plain |" in table
    assert "| GPT2 (b2, 64 tokens) | optimal (default) | 4.0 / 4.0 / 4.0 | 40% | 1.20× | 3.0 " \
           "| 1.5× | rewritten |" in table
    # The budgets have their own section: target, measured, worst call, replans.
    strategies, budgets = table.split("**Budgets**")
    assert "**Strategies and caps**" in strategies and "budget" not in strategies.split("|", 1)[1]
    assert "| GPT2 | budget 0.3 × plain | raises: BudgetError: no plan |" in budgets
    assert "| GPT2 (b2, 64 tokens) | budget 0.5 × plain | 5.0 | 4.6 / 4.6 / 4.6 | 92% | 98% | 46% " \
           "| 1.10× | 3.0 + 2.5 | 1.5× + 1.2× | 1 | 1/1 | 1/1 |" in budgets
    assert (tmp_path / "zoo.png").stat().st_size > 10_000


def test_xla_device_check_exports_here_and_runs_where_only_jax_is(tmp_path):
    """benchmarks/xla_device.py: ``export`` writes the chain's HLO with its
    deviceless H100 figures; ``run`` (for the lent GPU machine, which has
    JAX and no TensorFlow) imports neither TensorFlow nor memsave."""
    from benchmarks import xla_gpu   # pylint: disable=import-outside-toplevel
    if not xla_gpu.available():
        pytest.skip("the xla extra is not installed")
    code = ("import runpy, sys; sys.modules['tensorflow'] = None; sys.modules['memsave'] = None; "
            "sys.argv = ['xla_device.py']; runpy.run_path('benchmarks/xla_device.py', "
            "run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0 and "usage: xla_device.py export|run DIR" in out.stderr
    from benchmarks import xla_device   # pylint: disable=import-outside-toplevel
    xla_device.MODELS, saved = ("chain",), xla_device.MODELS
    try:
        xla_device.export(str(tmp_path))
    finally:
        xla_device.MODELS = saved
    deviceless = json.loads((tmp_path / "deviceless.json").read_text())
    assert deviceless["chain_optimal.pb"] < 0.5 * deviceless["chain_plain.pb"]
    params = json.loads((tmp_path / "params.json").read_text())
    assert params["chain_plain.pb"] and (tmp_path / "chain_plain.pb").stat().st_size > 0


class _Compiled:   # what roofline_seconds and matmul_flops read of an executable
    def __init__(self, text):
        self.text = text

    def hlo_modules(self):
        return [type("Module", (), {"to_string": lambda _: self.text})()]


_HLO = """HloModule step, entry_computation_layout={(f32[64,128]{1,0})->f32[64,32]{1,0}}

%gemm (p0: f32[64,128], p1: f32[128,32]) -> f32[64,32] {
  %p0 = f32[64,128]{1,0} parameter(0)
  %p1 = f32[128,32]{1,0} parameter(1)
  ROOT %dot.1 = f32[64,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (state: (s32[], f32[64,32])) -> (s32[], f32[64,32]) {
  %state = (s32[], f32[64,32]{1,0}) parameter(0)
  %x = f32[64,32]{1,0} get-tuple-element(%state), index=1
  %t = f32[64,32]{1,0} fusion(%x), kind=kLoop, calls=%tanh_fusion
  %i = s32[] get-tuple-element(%state), index=0
  ROOT %next = (s32[], f32[64,32]{1,0}) tuple(%i, %t)
}

%tanh_fusion (q: f32[64,32]) -> f32[64,32] {
  %q = f32[64,32]{1,0} parameter(0)
  ROOT %tanh = f32[64,32]{1,0} tanh(%q)
}

ENTRY %main (a: f32[64,128], w: f32[128,32]) -> f32[64,32] {
  %a = f32[64,128]{1,0} parameter(0)
  %w = f32[128,32]{1,0} parameter(1)
  %m = f32[64,32]{1,0} fusion(%a, %w), kind=kCustom, calls=%gemm
  %v = f32[2048]{0} bitcast(%m)
  %z = s32[] constant(0)
  %init = (s32[], f32[64,32]{1,0}) tuple(%z, %m)
  %loop = (s32[], f32[64,32]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %out = f32[64,32]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_roofline_prices_each_kernel_by_its_dot_flops_or_its_bytes():
    """benchmarks/xla_gpu.py's roofline, on a module written by hand: the
    gemm fusion costs the longer of its FLOPs at the tensor cores' rate and
    its bytes at HBM bandwidth, the loop's tanh fusion its bytes once per
    known trip; views, tuples and constants cost nothing."""
    from benchmarks import xla_gpu   # pylint: disable=import-outside-toplevel
    compiled = _Compiled(_HLO)
    bandwidth = 3352320000000.0       # the H100 target's memory_bandwidth
    launch = xla_gpu.LAUNCH_SECONDS
    gemm_flops = 2 * 64 * 32 * 128
    gemm = max(gemm_flops / xla_gpu.DOT_FLOPS_PER_SECOND["f32"],
               4 * (64 * 128 + 128 * 32 + 64 * 32) / bandwidth) + launch
    tanh = 4 * 2 * 64 * 32 / bandwidth + launch
    assert xla_gpu.roofline_seconds(compiled) == pytest.approx(gemm + 5 * tanh)
    assert xla_gpu.matmul_flops(compiled) == gemm_flops
    assert xla_gpu.shape_bytes("(s32[], f32[64,32]{1,0}, bf16[8])") == 4 + 4 * 64 * 32 + 16
    with_convolution = _HLO + '// custom_call_target="__cudnn$convForward"'
    assert xla_gpu.roofline_seconds(_Compiled(with_convolution)) is None


def test_budget_sweep_lands_budgets_on_measured_plans():
    """benchmarks.budget_sweep: a budget's closest plan is the largest measured at or
    below it, and 'a plan within 10%' means one in [0.9, 1] of the budget."""
    from benchmarks import budget_sweep   # pylint: disable=import-outside-toplevel
    result = {"plain_mib": 100.0, "plans": [
        {"measured_mib": m, "estimated_mib": m, "recompute": 0.1} for m in (31.0, 44.0, 52.0, 68.0)]}
    at_half = budget_sweep.landing(result, 0.5)
    assert at_half["best"]["measured_mib"] == 44.0 and not at_half["exists"]
    at_seven = budget_sweep.landing(result, 0.7)
    assert at_seven["best"]["measured_mib"] == 68.0 and at_seven["exists"]
    assert not at_seven["in_kept_band"]   # 97%: past the 95% a budget loop keeps plans within
    assert budget_sweep.landing(result, 0.55)["in_kept_band"]   # 52 of 55: 94.5%
    below = budget_sweep.landing(result, 0.3)
    assert below["best"] is None and not below["exists"] and below["lowest_mib"] == 31.0
    assert budget_sweep._targets(0.2, 0.3, 0.05) == [0.2, 0.25, 0.3]   # pylint: disable=W0212


@pytest.mark.slow   # about a minute: a small keras-hub GPT2, a plan per distinct kept set
def test_budget_sweep_benchmark_quick(tmp_path):
    from benchmarks import budget_sweep   # pylint: disable=import-outside-toplevel
    stdout = _run(["benchmarks.budget_sweep", "--quick", "--models", "GPT2", "--step", "0.1",
                   "--budgets", "0.7"], tmp_path)
    data = json.loads((tmp_path / "budget_sweep_quick.json").read_text())
    (result,) = data["results"]
    assert result["plain_mib"] > 0 and len(result["plans"]) >= 3
    for plan in result["plans"]:
        assert plan["measured_mib"] > 0 and plan["estimated_mib"] > 0 and plan["targets"]
        # What its peak is made of: tensors and slack within the profiled call's peak.
        assert 0 < plan["tensors_mib"] and 0 <= plan["slack_mib"]
        assert plan["tensors_mib"] + plan["slack_mib"] <= 1.25 * plan["measured_mib"]
    assert "| GPT2 | %d | 0.7 × plain |" % len(result["plans"]) in stdout
    assert "| GPT2 | %d | " % len(result["plans"]) in stdout.split(budget_sweep.ERROR_SECTION)[1]


def test_budget_replay_settles_the_loop_on_stored_plans(tmp_path):
    """A two-model sweep: one with a plan at 92% of its budget (the loop
    settles within 10% in every draw), one whose every plan measures far
    over its estimate and the budget (no draw is within)."""
    def plans(pairs, plain):
        return [dict(estimated_mib=e, plain_estimated_mib=plain, measured_mib=m) for e, m in pairs]
    sweep = dict(budgets=[0.5], results=[
        dict(model="fits", plain_mib=200.0, plans=plans(
            [(40, 45), (70, 75), (86, 92), (120, 130)], 200.0)),
        dict(model="over", plain_mib=200.0, plans=plans([(40, 190), (60, 210)], 200.0))])
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(sweep))
    stdout = _run(["benchmarks.budget_replay", "--sweep", str(path), "--draws", "5",
                   "--plan-noise", "0", "--call-noise", "0", "--stem", "r"], tmp_path)
    data = json.loads((tmp_path / "r.json").read_text())
    fits, over = data["variants"]["the loop"]
    assert fits["model"] == "fits" and fits["band"] == fits["within"] == fits["held"] == 5
    assert over["within"] == 0 and over["budget_error"] == 5
    assert "| the loop | 10 |" in stdout
