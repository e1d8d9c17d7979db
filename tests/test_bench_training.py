"""bench/bench_training.py end to end on the CPU: the tiny models, eager, every provider that
runs on the CPU, through ``main(argv)``; the record it writes."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("transformers")

from bench import bench_training  # noqa: E402

MODELS = ("llama", "qwen3", "gemma3")
ON_CPU = ("hf", "torch", "tilenorm", "tilenorm+residual")
TRAIN_STEPS = 12


def test_smoke_run_records_every_provider(tmp_path):
    out = tmp_path / "training.json"
    returned = bench_training.main([
        "--device", "cpu", "--sizes", "tiny", "--modes", "eager", "--dtype", "float32",
        "--steps", "3", "--warmup", "1", "--train-steps", str(TRAIN_STEPS), "--budget-s", "0",
        "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["rows"] == returned["rows"]
    assert not record["failures"] and not record["skipped"]
    # Liger and Quack need CUDA: recorded as absent with the reason, not failed.
    assert set(record["absent"]) == {"liger", "quack"}
    rows = {(r["model"], r["provider"]): r for r in record["rows"]}
    assert set(rows) == {(m, p) for m in MODELS for p in ON_CPU}
    for (model, provider), r in rows.items():
        assert (r["size"], r["mode"]) == ("tiny", "eager")
        assert len(r["steps_ms"]) == 3
        assert all(math.isfinite(v) and v > 0 for v in r["steps_ms"])
        assert math.isfinite(r["step_ms"]) and r["step_ms"] > 0
        assert math.isfinite(r["loss0"]) and r["train_steps"] == TRAIN_STEPS
        if provider in bench_training.OURS:
            # fp32 on the CPU: tilenorm takes torch's reference path.
            assert r["loss0_rel"] < 1e-3 and r["train_loss_rel"] < 1e-3, (model, provider)
            assert r["param_grad_rel_max"] < 1e-3, (model, provider)
            assert r["norm_modules"] > 0
    # Every model's q/k norms and residual adds are patched where it has them.
    assert rows["qwen3", "tilenorm+residual"]["per_head_norms"] > 0
    assert all(rows[m, "tilenorm+residual"]["fused_layers"] > 0 for m in MODELS)
    assert all(rows[m, "tilenorm"]["fused_layers"] == 0 for m in MODELS)
    # The trained loss moved: the check compares a run that learned something.
    ref = record["references"]["llama/tiny"]["losses"]
    assert len(ref) == TRAIN_STEPS + 1 and ref[-1] < ref[0]
    assert {t["pass"] for t in record["targets"] if "loss" in t["target"]} == {True}
