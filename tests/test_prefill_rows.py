"""``prefill_rows``: the fast engine prefills a batch a group of sequences at a time into its static
buffers. Every registry policy the fast engine runs selects per sequence, so any grouping gives the
whole-batch prefill's tokens exactly; the stores write row slices; sweeps, records and run ids carry
it only where it changes the run; hf and bad values are refused before any model loads."""


import pytest
import torch
from tiny_models import load_tiny_d32, registry_kwargs

from kvlab.engine import EngineError, prefill_rows
from kvlab.engine.engines import make_engine
from kvlab.engine.fast import FastEngine
from kvlab.kernels import make_format, quantize_write
from kvlab.measure import measure_generation
from kvlab.policies import POLICIES, PolicyError, make_policy
from kvlab.storage.dense import DenseStore
from kvlab.storage.kvq import QuantizedStore
from kvlab.storage.slots import Layout
from kvlab.sweep.checks import check_params
from kvlab.sweep.params import ParamsError, parse_params
from kvlab.sweep.plan import expand

N = 64
NEW = 6
BATCH = 3


@pytest.fixture(scope="module")
def lm():
    return load_tiny_d32()


def runs_on_fast(name: str) -> bool:
    try:
        make_policy(name, **registry_kwargs(name, pyramid_beta=2)).storage()
    except PolicyError:
        return False  # hqq (no kernel), decoding (shrinks the cache while decoding)
    return True


FAST = [name for name in POLICIES if runs_on_fast(name)]
# evict-then-quantize into a kvlab store, and a chunked prefill inside each row group
EXTRA = [("snapkv", {"quant": {"backend": "kvq", "nbits": 4, "q_group_size": 32}}),
         ("pyramidkv", {"quant": {"backend": "kvq", "nbits": 8}}),
         ("tova", {"prefill_chunk": 16}), ("kvq-int4", {"prefill_chunk": 24})]


def prompt(batch=BATCH, n=N, seed=1):
    return torch.randint(3, 512, (batch, n), generator=torch.Generator().manual_seed(seed))


def fast_tokens(lm, policy, ids, rows):
    """Prefill (``rows`` sequences at a time) and decode on a fresh engine: no buffer left over from
    another grouping can hide a row that was never written."""
    decoder = FastEngine(lm).decoder(policy, ids.shape[0], ids.shape[1], NEW)
    first = decoder.prefill(ids, policy.prefill_chunk, rows)
    return decoder.decode(first, NEW, ids.shape[1]), decoder


@pytest.mark.parametrize("method,extra", [(m, {}) for m in FAST] + EXTRA,
                         ids=[*FAST, *(f"{m}-{next(iter(e))}" for m, e in EXTRA)])
def test_row_groups_give_the_whole_batch_tokens(lm, method, extra):
    policy = make_policy(method, **{**registry_kwargs(method, pyramid_beta=2), **extra})
    with policy.attach(lm, warm=False):
        ids = prompt()
        whole, decoder = fast_tokens(lm, policy, ids, None)
        for rows in (1, 2):
            grouped, _ = fast_tokens(lm, policy, ids, rows)
            assert torch.equal(grouped, whole), rows
    assert whole.shape == (BATCH, NEW)
    assert not torch.equal(whole[0], whole[1])  # the rows are different sequences
    if method == "pyramidkv":
        assert len(set(decoder.layout.kept)) > 1  # per-layer lengths


def test_random_draws_the_same_positions_for_every_sequence(lm):
    """random's draw is per layer and KV head, not per batch row: a sequence keeps the same positions
    whichever row it sits in, and row 0 keeps what it kept before the draw was made per row."""
    from kvlab.engine.generation import prefill
    from kvlab.policies import kept_positions

    policy = make_policy("random", keep=0.3, seed=3)
    caches = []
    for batch in (1, BATCH):
        cache = policy.make_cache(lm.model)
        prefill(lm.model, prompt(batch), cache)
        caches.append(kept_positions(cache))
    for layer, (one, many) in enumerate(zip(*caches, strict=True)):
        assert torch.equal(many, one.expand_as(many))
        draw = torch.rand(1, one.shape[1], N, generator=torch.Generator().manual_seed(3 * 100_003 + layer))
        assert torch.equal(one.long(), draw.topk(one.shape[-1], dim=-1).indices.sort(dim=-1).values)


@pytest.mark.parametrize("kv_format", ["model", "fp8", "int4-g32"])
def test_stores_load_a_slice_of_rows_and_nothing_else(kv_format):
    layout = Layout(batch=4, kept=(5, 3), new_tokens=2, kv_heads=2, head_dim=32)
    store = (DenseStore(layout, torch.float32, "cpu", 1.0) if kv_format == "model"
             else QuantizedStore(layout, kv_format, 4, torch.float32, "cpu", 1.0))
    whole = (DenseStore(layout, torch.float32, "cpu", 1.0) if kv_format == "model"
             else QuantizedStore(layout, kv_format, 4, torch.float32, "cpu", 1.0))
    gen = torch.Generator().manual_seed(0)
    kv = [(torch.randn(4, 2, n, 32, generator=gen), torch.randn(4, 2, n, 32, generator=gen)) for n in layout.kept]
    whole.load(kv)
    store.load([(k[1:3], v[1:3]) for k, v in kv], rows=slice(1, 3))
    for a, b in zip(store.buffers()[:4], whole.buffers()[:4], strict=True):  # K/V (codes) of both layers
        a, b = (a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn else (a, b)
        assert torch.equal(a[1:3], b[1:3])  # batch rows are dim 0 of every buffer
        assert not a[0].any() and not a[3].any()
    store.load([(k[:1], v[:1]) for k, v in kv], rows=slice(0, 1))
    store.load([(k[3:], v[3:]) for k, v in kv], rows=slice(3, 4))
    for a, b in zip(store.buffers(), whole.buffers(), strict=True):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
    with pytest.raises(ValueError, match="holds 2 sequences, rows 0:1"):
        store.load([(k[1:3], v[1:3]) for k, v in kv], rows=slice(0, 1))
    with pytest.raises(ValueError, match="contiguous slice"):
        store.load([(k[::2], v[::2]) for k, v in kv], rows=slice(0, 4, 2))


@pytest.mark.parametrize("name,group", [("bf16", None), ("fp8", None), ("int4", 32), ("int2", 64)])
def test_a_row_slice_of_a_kernel_store_is_written_in_place(name, group):
    fmt = make_format(name, group=group)
    store, want = fmt.alloc(4, 2, 6, 64), fmt.alloc(4, 2, 6, 64)
    x = torch.randn(4, 2, 3, 64, generator=torch.Generator().manual_seed(1))
    slots = torch.tensor([0, 4, 2])
    fmt.write(want, x, slots)
    part = store.rows(slice(2, 4))
    assert part.batch == 2 and all(t.is_contiguous() for t in part.tensors())
    quantize_write(part, x[2:], slots)
    assert torch.equal(store.dequantize()[2:], want.dequantize()[2:])
    assert not store.dequantize()[:2].any()
    with pytest.raises(ValueError, match="contiguous slice"):
        store.rows(slice(0, 4, 2))
    with pytest.raises(ValueError, match="hold no batch row"):
        store.rows(slice(4, 6))


def test_prefill_rows_is_the_groups_a_run_uses():
    assert prefill_rows(None, 8) is None
    assert prefill_rows(2, 8) == 2 and prefill_rows(7, 8, "fast") == 7
    assert prefill_rows(8, 8) is None and prefill_rows(9, 8, "hf") is None  # one group: the plain prefill
    with pytest.raises(EngineError, match="needs the fast engine, not hf"):
        prefill_rows(2, 8, "hf")
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(EngineError, match="whole number of sequences >= 1"):
            prefill_rows(bad, 8)


def test_measure_records_the_groups_and_keeps_the_tokens(lm):
    policy = make_policy("snapkv", keep=0.3, window_size=8)
    with policy.attach(lm, warm=False):
        engine = FastEngine(lm, max_decoders=1)
        kw = dict(ctx=N, batch=BATCH, new_tokens=4, input_ids=prompt(), engine=engine)
        whole = measure_generation(lm, policy, **kw)
        grouped = measure_generation(lm, policy, prefill_rows=2, **kw)
        one_group = measure_generation(lm, policy, prefill_rows=BATCH, **kw)
        with pytest.raises(EngineError, match="needs the fast engine"):
            measure_generation(lm, policy, **{**kw, "engine": make_engine("hf", lm)}, prefill_rows=1)
    assert torch.equal(grouped.tokens, whole.tokens)
    assert (whole.record["prefill_rows"], grouped.record["prefill_rows"], one_group.record["prefill_rows"]) == \
        (None, 2, None)
    assert grouped.record["cache_bytes"] == whole.record["cache_bytes"]
    assert grouped.record["cache_logical_tokens"] == N


GOOD = {"models": "tiny-llama", "weights": "synthetic", "device": "cpu", "methods": ["full", "snapkv"],
        "keep": 0.5, "ctx": [32], "new_tokens": 3, "engine": "fast"}


@pytest.mark.parametrize("value", [0, -2, True, 1.5, [1, 2], "two"])
def test_bad_prefill_rows_values_name_the_key(value):
    with pytest.raises(ParamsError, match="prefill_rows"):
        parse_params({**GOOD, "prefill_rows": value})


@pytest.mark.parametrize("extra,match", [
    ({"engine": ["hf", "fast"]}, "prefill_rows: needs engine: fast only"),
    ({"engine": "hf"}, "set engine: fast"),
    ({"budget_gb": 1.0}, "prefill_rows: not with budget_gb"),
])
def test_prefill_rows_with_hf_or_a_budget_is_refused(extra, match):
    with pytest.raises(ParamsError, match=match):
        check_params(parse_params({**GOOD, "prefill_rows": 2, **extra}), check_device=False)


def test_run_ids_change_only_where_the_groups_do():
    """Unset, or at least the batch: the plain prefill's run id (published records still resume);
    below the batch: its own id, and the run carries it."""
    def runs(**extra):
        params = parse_params({**GOOD, "batch": [1, 4], **extra})
        return {(r.batch, r.method): r for r in expand(params, check_params(params, check_device=False))}

    plain, rows2, rows4 = runs(), runs(prefill_rows=2), runs(prefill_rows=4)
    assert "prefill_rows" not in plain[(4, "full")].identity()
    for key, run in plain.items():
        assert rows4[key].run_id == run.run_id and rows4[key].prefill_rows is None
        if key[0] == 1:
            assert rows2[key].run_id == run.run_id
        else:
            assert rows2[key].run_id != run.run_id and rows2[key].prefill_rows == 2


def test_a_fast_sweep_in_row_groups_records_them(tmp_path):
    from kvlab.records import read_records
    from kvlab.sweep.driver import run_sweep

    params = parse_params({**GOOD, "batch": [1, 3], "prefill_rows": 2, "warmup_runs": 0, "threads": 1,
                           "methods": ["snapkv"]})
    summary = run_sweep(params, tmp_path, check_device=False, progress=False, log=lambda _: None)
    assert summary.status == "complete"
    recs = {r["batch"]: r for r in read_records(tmp_path / "records.jsonl") if r.get("kind") == "perf"}
    assert (recs[1]["prefill_rows"], recs[3]["prefill_rows"]) == (None, 2)
    assert recs[3]["engine"] == "fast" and recs[3]["status"] == "ok"
