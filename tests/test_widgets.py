"""The byte-budget explorer without a browser: table functions against kvlab.budget, and the
ipywidgets wiring driven by setting control values."""

import pytest

from kvlab import budget, widgets
from kvlab.models import get_spec


@pytest.fixture(scope="module")
def llama8b():
    return get_spec("llama-3.1-8b")


def test_formats_full_first_then_widest(llama8b):
    formats = widgets.cache_formats(llama8b, bits=(2, 4, 8), group_size=64, residual=128)
    assert [f.name for f in formats] == ["bfloat16 (full)", "int8 g64 r128", "int4 g64 r128", "int2 g64 r128"]
    assert formats[0].bits == 16 and formats[0].residual == 0
    with pytest.raises(budget.BudgetError, match="bits: 5 is not a stored width"):
        widgets.cache_formats(llama8b, bits=(5,))


def test_context_grid():
    assert widgets.context_grid(4096) == [256, 512, 1024, 2048, 4096]
    assert widgets.context_grid(3000) == [256, 512, 1024, 2048, 3000]


def test_per_token_steps_multiply_out(llama8b):
    steps = widgets.per_token_steps(llama8b).set_index("factor")["value"]
    assert steps["elements per token"] == 32 * 8 * 128 * 2
    assert steps["bytes per token"] == 131072
    q = widgets.per_token_steps(llama8b, bits=4, group_size=64).set_index("factor")["value"]
    assert q["bits per element"] == 4.5 and q["bytes per token"] == 36864


def test_cache_table_matches_budget(llama8b):
    formats = widgets.cache_formats(llama8b, bits=(4,))
    t = widgets.cache_table(llama8b, formats, [8192, 16384], batch=2)
    full = t[t["format"] == "bfloat16 (full)"].set_index("ctx")["cache_bytes"]
    assert full[8192] == 2 * 1024**3 and full[16384] == 4 * 1024**3


def test_compression_below_nominal_and_rising_with_context(llama8b):
    formats = widgets.cache_formats(llama8b, bits=(4,), residual=128)
    t = widgets.compression_table(llama8b, formats, [256, 1024, 16384, 131072])
    ratios = list(t["ratio"])
    assert ratios == sorted(ratios)  # the residual buffer matters less as context grows
    assert ratios[0] < 2.0  # short contexts compress ~2x at most
    assert all(r < n for r, n in zip(t["ratio"], t["nominal"], strict=True))
    assert t["nominal"].iloc[0] == pytest.approx(16 / 4.5)
    assert ratios[-1] == pytest.approx(16 / 4.5, rel=0.01)


def test_capacity_grows_as_bits_shrink(llama8b):
    formats = widgets.cache_formats(llama8b)
    t = widgets.capacity_table(llama8b, formats, 16384, budget.get_gpu("rtx-a6000"))
    batches = list(t["max_batch"])
    assert batches == sorted(batches) and batches[0] < batches[-1]
    assert batches[0] == budget.max_batch(llama8b, 16384, 48e9)


def test_decode_weights_same_for_every_format(llama8b):
    t = widgets.decode_table(llama8b, widgets.cache_formats(llama8b), 16384, gpu=budget.get_gpu("h100-sxm"))
    assert t["weight_bytes"].nunique() == 1
    assert list(t["kv_bytes"]) == sorted(t["kv_bytes"], reverse=True)
    assert t["floor_ms"].iloc[0] == pytest.approx(t["total_bytes"].iloc[0] / 3350e9 * 1e3)


def test_budget_views_gives_four_figures_and_a_summary():
    views = widgets.budget_views(widgets.BudgetInputs(model="mistral-7b", ctx=4096, batch=8, gpu="h100-sxm"))
    assert set(views.figures) == {"cache", "capacity", "decode", "compression"}
    assert set(views.tables) == set(views.figures)
    assert len(views.summary) == 4
    assert "batch 8" in views.figures["cache"].layout.title.text
    assert views.summary["cache GB"].iloc[0] == pytest.approx(
        budget.cache_bytes(get_spec("mistral-7b"), 4096, batch=8) / 1e9)


def test_inputs_validate_with_the_budget_messages():
    with pytest.raises(budget.BudgetError, match="head dim 64"):
        widgets.BudgetInputs(model="smollm2-135m", group_size=128)
    with pytest.raises(budget.BudgetError, match="unknown GPU"):
        widgets.BudgetInputs(gpu="rtx-9999")
    with pytest.raises(budget.BudgetError, match="ctx"):
        widgets.BudgetInputs(ctx=0)


def test_explorer_recomputes_when_a_control_changes():
    ex = widgets.budget_explorer(model="llama-3.1-8b", ctx=16384)
    first = ex.state
    assert first.inputs.ctx == 16384 and "16,384 tokens" in ex.message.value
    ex.controls["ctx"].value = 4096
    assert ex.state is not first and ex.state.inputs.ctx == 4096
    assert ex.state.tables["capacity"]["ctx"].iloc[0] == 4096
    ex.controls["bits"].value = (2,)
    assert list(ex.state.summary["format"]) == ["bfloat16 (full)", "int2 g64 r128"]
    ex.controls["gpu"].value = "h200"
    assert ex.state.tables["capacity"]["gpu"].iloc[0] == "H200"


def test_explorer_shows_the_error_and_recovers():
    ex = widgets.budget_explorer(model="llama-3.1-8b")
    ex.controls["group_size"].value = 128
    ex.controls["model"].value = "smollm2-135m"  # head dim 64: group 128 does not divide it
    assert ex.state is None
    assert "does not divide" in ex.message.value
    ex.controls["group_size"].value = 32
    assert ex.state is not None and ex.state.inputs.model == "smollm2-135m"


def test_explorer_is_displayable():
    ex = widgets.budget_explorer()
    bundle = ex._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle


def test_a_model_whose_weights_exceed_the_gpu_says_so_and_draws_no_negative_room():
    from kvlab import plots

    views = widgets.budget_views(widgets.BudgetInputs(model="llama-3.1-70b", gpu="rtx-a6000"))
    assert views.fit == ["does not fit: llama-3.1-70b's weights alone (141.1 GB in bfloat16) exceed "
                         "RTX A6000's 48 GB, at any context"]
    assert set(views.summary["fits on RTX A6000"]) == {"NO"}
    assert plots.is_empty(views.figures["capacity"])  # one sentence, not bars of 0
    cache = views.figures["cache"]
    assert not cache.layout.shapes  # no "free after weights: -95.3 GB" line
    assert "weights alone" in cache.layout.annotations[0].text
    assert "does not fit" in widgets._summary_html(views)


def test_a_cache_larger_than_free_memory_says_which_formats_do_not_fit():
    views = widgets.budget_views(widgets.BudgetInputs(model="llama-3.1-8b", gpu="h200", batch=256))
    assert [line.split(":")[0] for line in views.fit] == ["bfloat16 (full)", "int8 g64 r128", "int4 g64 r128"]
    assert "549.8 GB" in views.fit[0] and "max batch 57" in views.fit[0]
    assert list(views.summary["fits on H200"]) == ["NO", "NO", "NO", "yes"]
    ok = widgets.budget_views(widgets.BudgetInputs())
    assert ok.fit == [] and widgets.fit_text(ok).startswith("every cache format fits")


def test_bar_labels_have_room_above_the_bars():
    views = widgets.budget_views(widgets.BudgetInputs(model="llama-3.1-8b", gpu="h200"))
    cap = views.figures["capacity"]
    assert cap.data[0].cliponaxis is False and cap.layout.yaxis.range[1] > max(cap.data[0].y)
    floor = views.figures["decode"].data[-1]
    assert floor.cliponaxis is False


def test_fit_problem_is_none_when_everything_fits(llama8b):
    gpu = budget.get_gpu("h200")
    assert budget.fit_problem(llama8b, 16384, 1, gpu.memory_bytes) is None
    assert "no room" in budget.fit_problem(llama8b, 16384, 1, 17e9, gpu_name="a 17 GB GPU")
