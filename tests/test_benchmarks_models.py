"""benchmarks.models and benchmarks.rewrite_speed run end to end at tiny sizes."""

import json
import numbers

import pytest

from benchmarks import models, rewrite_speed


@pytest.mark.heavy
def test_models_benchmark_tiny(tmp_path):
    result = models.run(quick=True, tiny=True, out_dir=tmp_path, log=None)
    data = json.loads((tmp_path / "models.json").read_text())
    assert data["meta"]["tf_version"] and data["meta"]["cpus"]
    assert set(data["models"]) == set(models.MODELS)
    seen = {(r["model"], r["method"]): r for r in data["rows"]}
    assert set(seen) == {(m, k) for m in models.MODELS for k in models.METHODS}
    for (model, method), row in seen.items():
        if row["na"] is not None:
            # Only a strategy or peer that cannot apply may be missing, with a reason.
            assert row["na"].startswith("n/a: ") and len(row["na"]) > 10, row
            assert method in ("memory", "tf.recompute_grad"), row
            continue
        assert isinstance(row["peak_mb"], numbers.Real) and row["peak_mb"] > 0, row
        assert isinstance(row["time_ratio"], numbers.Real) and row["time_ratio"] > 0, row
        if row["mode"] == "session":
            assert row["rewrite_s"] is not None and row["rewrite_s"] >= 0, row
    for model in models.MODELS:
        assert seen[(model, "optimal")]["peak_mb"] < seen[(model, "plain")]["peak_mb"], model
    # The U-Net is not a sequence: tf.recompute_grad in sqrt(n) blocks does not apply.
    assert seen[("unet", "tf.recompute_grad")]["na"].startswith("n/a: ")
    assert "| optimal |" in (tmp_path / "models.md").read_text()
    assert result["markdown"] == (tmp_path / "models.md").read_text()


@pytest.mark.heavy
def test_rewrite_speed_benchmark_tiny(tmp_path):
    rewrite_speed.run(quick=True, out_dir=tmp_path, sizes=[200, 400], runs=1, log=None)
    data = json.loads((tmp_path / "rewrite_speed.json").read_text())
    rows = {(r["target_ops"], r["variant"]): r for r in data["rows"]}
    assert set(rows) == {(n, v) for n in (200, 400) for v in rewrite_speed.VARIANTS}
    for row in rows.values():
        assert row["seconds"] > 0 and row["s_per_1k_ops"] > 0, row
        assert abs(row["forward_ops"] - row["target_ops"]) < 0.2 * row["target_ops"], row
    for n in (200, 400):
        assert rows[(n, "plan optimal")]["checkpoints"] > 0
        grown = rows[(n, "gradients optimal")]["ops_after"]
        assert grown > rows[(n, "plan optimal")]["forward_ops"]
    assert "| variant |" in (tmp_path / "rewrite_speed.md").read_text()
