"""bench/bench_training.py end to end on the CPU: the tiny models, eager, every provider that
runs on the CPU, through ``main(argv)``; the record it writes."""

from __future__ import annotations

import collections
import json
import math
import statistics

import pytest
import torch

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
    # Llama and Qwen3 also fuse the add ending each layer with the next norm; Gemma3 does not.
    assert all((rows[m, "tilenorm+residual"]["fused_across"] > 0) == (m != "gemma3")
               for m in MODELS)
    assert all(rows[m, "tilenorm"]["fused_across"] == 0 for m in MODELS)
    # The trained loss moved: the check compares a run that learned something.
    ref = record["references"]["llama/tiny"]["losses"]
    assert len(ref) == TRAIN_STEPS + 1 and ref[-1] < ref[0]
    assert {t["pass"] for t in record["targets"] if "loss" in t["target"]} == {True}


class _FakeRunner:
    """Stands in for ``bench_training.Runner`` in ``time_rounds``: logs each turn."""

    def __init__(self, name: str, log: list, fail_at_turn: int | None = None):
        self.name, self.log, self.fail_at_turn = name, log, fail_at_turn
        self.step_ms: list[float] = []
        self.turn_ms: list[float] = []
        self.turns = 0

    def timed(self, steps: int) -> list[float]:
        self.turns += 1
        if self.turns == self.fail_at_turn:
            raise RuntimeError(f"{self.name} broke")
        self.log.append((self.name, steps))
        return [float(len(self.log)) + i for i in range(steps)]


def test_time_rounds_interleaves_and_balances():
    log: list = []
    runners = {n: _FakeRunner(n, log) for n in "abc"}
    failed: dict = {}
    rounds = bench_training.time_rounds(dict(runners), steps=5, round_steps=2, failed=failed)
    assert rounds == 3 and not failed
    # One untimed round, then round k of every runner before round k + 1 of any, in the rows
    # of a Williams design (round_order); the last round runs what is left of the steps.
    assert log == [("a", 2), ("b", 2), ("c", 2),
                   ("b", 2), ("c", 2), ("a", 2),
                   ("c", 2), ("a", 2), ("b", 2),
                   ("c", 1), ("b", 1), ("a", 1)]
    # Only the timed rounds' steps are kept: those of turns 4 to 12 in the log.
    assert runners["a"].step_ms == [6.0, 7.0, 8.0, 9.0, 12.0]
    assert all(len(r.step_ms) == 5 for r in runners.values())
    # A turn's mean step time, one a timed turn: its steps' times sum to the turn's.
    assert runners["a"].turn_ms == [6.5, 8.5, 12.0]


@pytest.mark.parametrize("count", range(1, 8))
def test_round_order_balances_places_and_predecessors(count):
    """Over a cycle of rounds every provider takes each place in the round equally often and
    follows each other provider equally often (a rotation kept each one's neighbours: in six
    providers tilenorm+residual ran before hf in five rounds of six)."""
    names = [f"p{i}" for i in range(count)]
    cycle = count if count % 2 == 0 else 2 * count
    orders = [bench_training.round_order(names, k) for k in range(cycle)]
    assert all(sorted(o) == names for o in orders)
    places = collections.Counter((n, o.index(n)) for o in orders for n in o)
    assert set(places.values()) == {cycle // count}
    after = collections.Counter(pair for o in orders for pair in zip(o[:-1], o[1:], strict=True))
    assert len(after) == count * (count - 1) and len(set(after.values())) <= 1
    assert bench_training.round_order(names, cycle) == orders[0]


def test_time_rounds_drops_a_failing_runner():
    log: list = []
    runners = {"a": _FakeRunner("a", log), "b": _FakeRunner("b", log, fail_at_turn=2)}
    failed: dict = {}
    bench_training.time_rounds(runners, steps=4, round_steps=2, failed=failed)
    assert set(failed) == {"b"} and "broke" in str(failed["b"])
    assert set(runners) == {"a"} and len(runners["a"].step_ms) == 4


@pytest.mark.parametrize("timing", ["interleaved", "sequential"])
def test_timing_modes_record_every_provider(tmp_path, timing):
    out = tmp_path / "training.json"
    bench_training.main([
        "--device", "cpu", "--sizes", "tiny", "--modes", "eager", "--dtype", "float32",
        "--models", "llama", "--providers", "hf,torch", "--steps", "4", "--round-steps", "2",
        "--warmup", "1", "--train-steps", "3", "--budget-s", "0", "--timing", timing,
        "--profile", "--out", str(out)])
    record = json.loads(out.read_text())
    assert not record["failures"] and not record["skipped"]
    assert record["args"]["timing"] == timing
    rows = {r["provider"]: r for r in record["rows"]}
    assert set(rows) == {"hf", "torch"}
    for r in rows.values():
        assert (r["timing"], r["rounds"], r["round_steps"]) == (timing, 2, 2)
        assert len(r["steps_ms"]) == 4 and all(v > 0 for v in r["steps_ms"])
        assert r["step_ms"] > 0 and r["config_s"] > 0
        # Both got their step-0 check and trained-loss check before the timed rounds.
        assert r["train_steps"] == 3 and r["loss0_rel"] < 1e-3 and r["train_loss_rel"] < 1e-3
        assert r["profile_steps"] == bench_training.PROFILE_STEPS
        top = r["profile_top"]
        assert 0 < len(top) <= bench_training.PROFILE_TOP
        assert all(e["count"] > 0 and e["self_cpu_us"] >= 0 and e["name"] for e in top)
        assert [e["self_cpu_us"] for e in top] == sorted((e["self_cpu_us"] for e in top),
                                                         reverse=True)
        assert "profile_kernels" not in r, "kernels are profiled on a GPU only"
        assert r["commit"] == record["commit"], "each row names the commit that wrote it"


def test_batches_hold_no_special_ids():
    size = bench_training.SIZES["tiny"]
    ids = bench_training.make_batches(size, 8, 1, bench_training.torch.device("cpu"))
    assert ids.shape == (8, size.batch, size.seq)
    assert int(ids.min()) >= bench_training.FIRST_TEXT_ID
    assert int(ids.max()) < size.vocab
    assert max(bench_training.SPECIAL_IDS.values()) < bench_training.FIRST_TEXT_ID
    # Still a Zipf law: the first text id is the most frequent.
    counts = ids.flatten().bincount(minlength=size.vocab)
    assert int(counts.argmax()) == bench_training.FIRST_TEXT_ID


def test_gemma3_tiny_bf16_is_finite_and_trains(tmp_path):
    out = tmp_path / "training.json"
    record = bench_training.main([
        "--device", "cpu", "--sizes", "tiny", "--modes", "eager", "--dtype", "bfloat16",
        "--models", "gemma3", "--providers", "hf", "--steps", "2", "--warmup", "1",
        "--train-steps", str(TRAIN_STEPS), "--budget-s", "0", "--out", str(out)])
    assert not record["failures"]
    (row,) = record["rows"]
    assert math.isfinite(row["loss0"]) and math.isfinite(row["grad_norm"])
    assert row["grad_norm"] > 0 and row["param_grad_rel_max"] == 0.0
    ref = record["references"]["gemma3/tiny"]
    assert math.isfinite(ref["grad_norm"])
    assert all(math.isfinite(v) for v in ref["losses"]) and ref["losses"][-1] < ref["losses"][0]


def test_gemma3_host_step0_gradients_are_finite():
    """The configuration that diverged (#41): HF's Gemma3 at the host size, 8 layers, on the
    benchmark's first batch. With the pad id in the batches, a sequence starting with it kept a
    zero residual row whose norms' backward overflowed; fp32 overflowed as bf16 did."""
    torch = bench_training.torch
    spec, size = bench_training.MODELS["gemma3"], bench_training.SIZES["host"]
    device = torch.device("cpu")
    model = bench_training.build_base(spec, size, device, torch.float32, 0)
    ids = bench_training.make_batches(size, 1, 1, device)[0]
    loss = bench_training.forward_backward(model, ids)
    assert math.isfinite(float(loss))
    norms = bench_training.grad_norms(model)
    bad = [n for n, v in norms.items() if not math.isfinite(v)]
    assert not bad, bad


def test_step_targets_pass_unless_the_paired_test_finds_ours_slower():
    """A step-time target passes where the sign test over paired turns does not find ours
    slower: a tie with a slightly higher median passes, 16 of 20 turns lost fails."""

    def row(provider, turns):
        return {"model": "llama", "size": "host", "mode": "eager", "provider": provider,
                "step_ms": statistics.median(turns), "turns_ms": turns, "loss0_rel": 0.0,
                "param_grad_rel_max": 0.0, "train_loss_rel": None}

    base = [10.0 + (i % 5) for i in range(20)]
    tie = [t * (1.01 if i % 2 else 0.995) for i, t in enumerate(base)]
    slower = [t * (1.05 if i < 16 else 0.95) for i, t in enumerate(base)]
    for ours, verdict in ((tie, "tie"), (slower, "slower")):
        rows = [row("torch", base), row("tilenorm", ours), row("tilenorm+residual", ours)]
        found = {t["target"]: t for t in bench_training.targets(rows, torch.bfloat16)}
        target = found["llama host eager: tilenorm step <= torch"]
        assert target["paired"]["verdict"] == verdict
        assert target["pass"] is (verdict != "slower")


def test_fastest_is_judged_against_every_provider():
    """ours ties the provider with the lowest median but loses 16 of 20 turns to another:
    "fastest" fails, against that one."""

    def row(provider, turns):
        return {"model": "llama", "size": "gpu", "mode": "eager", "provider": provider,
                "step_ms": statistics.median(turns), "turns_ms": turns, "loss0_rel": 0.0,
                "param_grad_rel_max": 0.0, "train_loss_rel": None}

    noisy = [8.0 if i % 2 else 12.0 for i in range(20)]  # the lowest median, 10.0
    steady = [10.2] * 20
    ours = [10.4 if i < 16 else 10.1 for i in range(20)]  # 16 of 20 turns behind torch
    rows = [row("hf", noisy), row("torch", steady), row("tilenorm+residual", ours)]
    found = {t["target"]: t for t in bench_training.targets(rows, torch.bfloat16)}
    target = found["llama gpu eager: tilenorm+residual fastest"]
    assert bench_training.paired(rows[2], rows[0])["verdict"] != "slower"
    assert target["against"] == "torch" and target["paired"]["verdict"] == "slower"
    assert target["pass"] is False


def test_each_compiled_model_keeps_its_own_dynamo_cache():
    """Two models of one class, compiled for two providers: each call's entries sit on its
    own code object, so neither pays for testing the other's guards (bench/NOTES.md #67)."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    torch._dynamo.reset()
    models = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
              for _ in range(2)]
    models[1][1] = torch.nn.RMSNorm(8)  # another provider's norm: other guards, other graph
    calls = [bench_training.compiled_call(m) for m in models]
    x = torch.randn(4, 8)
    for m, call in zip(models, calls, strict=True):
        torch.testing.assert_close(call(x), m(x))
    codes = [call._torchdynamo_orig_callable.__code__ for call in calls]
    assert codes[0] is not codes[1]
    assert [len(_debug_get_cache_entry_list(c)) for c in codes] == [1, 1]
    torch._dynamo.reset()
