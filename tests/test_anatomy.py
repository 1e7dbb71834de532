"""Decode-step anatomy on CPU: op classification, the per-step arithmetic, and real profiles of the
tiny model with a full and a quantized cache."""

import pytest
import torch

from kvlab import anatomy
from kvlab.anatomy import GAP, OpTime
from kvlab.engine.anatomy import compare_methods, instrument
from kvlab.engine.engines import make_engine
from kvlab.engine.generation import cache_kwarg


@pytest.mark.parametrize(("chain", "category"), [
    (["aten::mm", "aten::matmul", "aten::linear", "kvlab::attention"], "weight GEMMs"),
    (["aten::cat", "kvlab::cache_update", "kvlab::attention"], "cache update/concat"),
    (["aten::cat", "kvlab::attention"], "attention"),  # RoPE's cat: attention module, not cache
    (["aten::_efficient_attention_forward", "aten::scaled_dot_product_attention"], "attention"),
    (["quanto::unpack", "kvlab::dequantize", "kvlab::cache_update"], "dequantize"),
    (["aten::bitwise_and", "kvlab::dequantize", "kvlab::cache_update"], "dequantize"),
    (["aten::round", "kvlab::quantize", "kvlab::cache_update"], "quantize"),
    (["quanto::quantize_affine"], "quantize"),
    (["aten::embedding"], "other ops"),
    (["aten::mul", "aten::rms_norm"], "other ops"),
])
def test_classify(chain, category):
    assert anatomy.classify(chain) == category


def test_breakdown_per_step_and_gap():
    ops = [OpTime("aten::mm", ["aten::linear"], 4000.0), OpTime("aten::cat", ["kvlab::cache_update"], 1000.0),
           OpTime("aten::add", [], 1000.0)]
    by, busy, table = anatomy.breakdown(ops, wall_s=0.010, steps=2)
    assert by["weight GEMMs"] == 2.0 and by["cache update/concat"] == 0.5 and by["other ops"] == 0.5
    assert busy == 3.0
    assert by[GAP] == pytest.approx(2.0)  # 5 ms wall per step - 3 ms busy
    assert set(by) == set(anatomy.CATEGORIES)
    assert table.set_index("op").loc["aten::mm", "calls_per_step"] == 0.5
    with pytest.raises(anatomy.AnatomyError, match="steps"):
        anatomy.breakdown(ops, 0.01, 0)


def test_step_profiler_needs_warmup():
    with pytest.raises(anatomy.AnatomyError, match="warmup"):
        anatomy.StepProfiler("cpu", steps=4, warmup=0)


def _decode_loop(loaded, cache, ctx=64):
    """A plain transformers decode loop (independent of kvlab's generation) for the profiler tests."""
    model = loaded.model
    kw = cache_kwarg(model)
    ids = anatomy.synthetic_prompt(loaded.spec.vocab_size, ctx)
    state = {"pos": ctx}
    with torch.inference_mode():
        state["tok"] = model(input_ids=ids, use_cache=True, **{kw: cache}).logits[:, -1:].argmax(-1)

    def step():
        with torch.inference_mode():
            out = model(input_ids=state["tok"], position_ids=torch.tensor([[state["pos"]]]), use_cache=True,
                        **{kw: cache})
        state["tok"] = out.logits[:, -1:].argmax(-1)
        state["pos"] += 1

    return step


def test_profile_full_cache_on_cpu(tiny):
    from transformers import DynamicCache

    cache = DynamicCache(config=tiny.model.config)
    step = _decode_loop(tiny, cache)
    with instrument(tiny.model, cache):
        result = anatomy.profile_loop(step, "full", steps=3, warmup=1)
    assert "update" not in cache.__dict__  # instrumentation removed
    by = result.by_category
    assert by["weight GEMMs"] > 0 and by["attention"] > 0 and by["cache update/concat"] > 0
    assert by["quantize"] == 0 and by["dequantize"] == 0
    assert result.wall_ms >= result.busy_ms
    assert sum(by.values()) == pytest.approx(result.wall_ms)
    rows = result.rows()
    assert [r["category"] for r in rows] == list(anatomy.CATEGORIES)
    # each of the 2 layers appends K and V once per step
    cats = result.ops.groupby("category")["calls_per_step"].sum()
    assert cats["cache update/concat"] >= 4


def test_profile_quantized_cache_shows_quantize_and_dequantize(tiny):
    pytest.importorskip("optimum.quanto")
    from transformers import QuantizedCache

    cache = QuantizedCache("quanto", tiny.model.config, nbits=4, q_group_size=16, residual_length=2)
    step = _decode_loop(tiny, cache)
    with instrument(tiny.model, cache):
        result = anatomy.profile_loop(step, "quanto int4", steps=4, warmup=1)
    assert result.by_category["dequantize"] > 0
    assert result.by_category["quantize"] > 0  # the residual of 2 flushes every other step
    assert all("_quantize" not in layer.__dict__ for layer in cache.layers)


def test_method_anatomy_through_policies_and_decode(tiny):
    pytest.importorskip("optimum.quanto")
    table, results = compare_methods(
        make_engine("hf", tiny), ["full", "quanto"], ctx=64, policy_params={"quanto": {"nbits": 4, "q_group_size": 16,
                                                                   "residual_length": 8}},
        steps=3, warmup=1)
    assert [r.method for r in results] == ["full", "quanto"]
    assert set(table["label"]) == {results[0].label, results[1].label}
    assert len(table) == 2 * len(anatomy.CATEGORIES)
    wide = anatomy.category_table(table)
    assert wide.loc[results[1].label, "dequantize"] > 0 and wide.loc[results[0].label, "dequantize"] == 0
    top = anatomy.top_ops_table(results, n=3)
    assert len(top) == 6 and list(top.columns) == ["label", "op", "category", "calls_per_step", "ms"]
