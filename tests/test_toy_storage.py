"""A new storage format is one module: this file registers a toy storage (bf16 codes with one scale per
sequence and KV head, fixed by the prompt) and runs it through both engines, ``kvlab generate``, a
sweep and the budget math, changing nothing in kvlab (the recipe in ARCHITECTURE.md, kept true).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from tiny_models import load_tiny_d32
from transformers.cache_utils import Cache, DynamicLayer

from kvlab.cli import main
from kvlab.engine.fast import FastEngine
from kvlab.engine.generation import greedy_decode, prefill
from kvlab.models import get_spec
from kvlab.policies import POLICIES, PolicyError, cache_stats, make_policy
from kvlab.policies.stored import storage_policy
from kvlab.records import read_jsonl
from kvlab.storage.base import StoredLengthMixin, check_int, storage_blocks, storage_bytes
from kvlab.storage.loading import PromptStorage
from kvlab.storage.slots import SlotStore, StepSlots, sdpa_decode
from kvlab.sweep.driver import run_sweep
from kvlab.sweep.params import parse_params

CODE = torch.bfloat16


def head_scale(x: torch.Tensor, floor: float) -> torch.Tensor:
    """One scale per (row, KV head): the amax of ``x [B, H, n, D]``, at least ``floor``; ``[B, H, 1, 1]``."""
    return x.detach().float().abs().amax(dim=(-2, -1), keepdim=True).clamp_min(floor)


class ToyLayer(StoredLengthMixin, DynamicLayer):
    """hf half: codes ``x / scale`` in bf16, the scale set by the first update (the prompt)."""

    def __init__(self, floor: float):
        super().__init__()
        self.floor, self.codes, self.scales, self.dtype = floor, None, None, None

    @property
    def stored_tokens(self) -> int:
        return 0 if self.codes is None else self.codes[0].shape[-2]

    def update(self, key_states, value_states, *args, **kwargs):
        first = not self.is_initialized
        if first:
            self.lazy_initialization(key_states, value_states)
            self.dtype = key_states.dtype
            self.scales = (head_scale(key_states, self.floor), head_scale(value_states, self.floor))
        new = tuple((x.float() / s).to(CODE) for x, s in zip((key_states, value_states), self.scales, strict=True))
        self.codes = new if first else tuple(torch.cat([c, n], 2) for c, n in zip(self.codes, new, strict=True))
        if first:
            return key_states, value_states
        return tuple((c.float() * s).to(self.dtype) for c, s in zip(self.codes, self.scales, strict=True))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.codes, *self.scales)) if self.codes else 0


class ToyStore(SlotStore):
    """fast half: per layer bf16 codes ``[B, H, C, D]`` and float32 scales ``[B, H, 1, 1]``."""

    rewinds = True
    attention = "sdpa"
    kv_format = "toy bf16, scale per head"

    def __init__(self, layout, dtype, device, scale: float, floor: float):
        self.layout, self.dtype, self.scale, self.floor = layout, dtype, scale, floor
        b, h, d = layout.batch, layout.kv_heads, layout.head_dim
        self.codes = [[torch.zeros(b, h, c, d, dtype=CODE, device=device) for _ in range(2)] for c in layout.capacity]
        self.scales = [[torch.ones(b, h, 1, 1, device=device) for _ in range(2)] for _ in layout.capacity]
        self.slots = StepSlots(layout.kept, b, device)

    def bytes_allocated(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def buffers(self) -> list[torch.Tensor]:
        return [t for layer in self.codes + self.scales for t in layer] + list(self.slots.tensors())

    def held_bytes(self, held: list[int]) -> int:
        h, d, b = self.layout.kv_heads, self.layout.head_dim, self.layout.batch
        return b * sum(n * 2 * h * d * CODE.itemsize + 2 * h * 4 for n in held)

    def _load_layer(self, layer, rows, k, v) -> None:
        for i, x in enumerate((k, v)):
            self.scales[layer][i][rows] = head_scale(x, self.floor)
            self.codes[layer][i][rows, :, :x.shape[-2]] = (x.float() / self.scales[layer][i][rows]).to(CODE)

    def _attend(self, layer, q, k, v) -> torch.Tensor:
        slot = self.slots.slot(layer)
        for i, x in enumerate((k, v)):
            self.codes[layer][i].index_copy_(2, slot, (x.float() / self.scales[layer][i]).to(CODE))
        keys, values = ((c.float() * s).to(self.dtype) for c, s in zip(self.codes[layer], self.scales[layer],
                                                                           strict=True))
        return sdpa_decode(q, keys, values, slot + 1, self.scale)


@dataclass(frozen=True)
class ToyStorage(PromptStorage):
    """The storage module a new format would be: its knobs, check, bytes, both halves (the loading of
    a prefilled cache and the paged layout are :class:`PromptStorage`'s defaults)."""

    name = "toy-scaled"
    summary = "toy: bf16 codes with one scale per sequence and KV head"
    attends_own_queries = False
    prefill = None
    bits = 16

    floor: float = field(default=1e-6, metadata={"help": "smallest scale"})
    block: int = field(default=16, metadata={"help": "tokens per paged block"})

    def __post_init__(self):
        check_int("block", self.block, minimum=1)
        if not isinstance(self.floor, float) or self.floor <= 0:
            raise PolicyError(f"floor must be a positive float, got {self.floor!r}")

    @property
    def label(self) -> str:
        return "toy scaled"

    def check(self, shape, cuda: bool) -> None:
        shape.check_full_attention("toy stores")

    def make_cache(self, num_layers: int):
        return Cache(layers=[ToyLayer(self.floor) for _ in range(num_layers)])

    def token_bytes(self, kv_heads: int, head_dim: int, element_size: int = 2) -> float:
        return 2 * kv_heads * head_dim * CODE.itemsize

    def store(self, layout, options):
        return ToyStore(layout, options.dtype, options.device, options.scale, self.floor)


@pytest.fixture
def toy(monkeypatch):
    """The one registration line, undone after the test."""
    monkeypatch.setitem(POLICIES, ToyStorage.name, storage_policy(ToyStorage))
    return ToyStorage.name


def test_hf_and_fast_hold_the_same_tokens_and_bytes(toy):
    loaded = load_tiny_d32()
    model = loaded.model
    policy = make_policy(toy)
    assert policy.params() == {"method": toy, "floor": 1e-6, "block": 16, "keep": 1.0, "bits": 16}
    prompt = torch.randint(3, 500, (2, 48), generator=torch.Generator().manual_seed(0))
    with policy.attach(loaded, warm=False):
        cache = policy.make_cache(model)
        first = prefill(model, prompt, cache)[:, -1].argmax(-1)
        ref = greedy_decode(model, cache, first, 12, prompt.shape[1])
        decoder = FastEngine(loaded).decoder(policy, 2, 48, 12)
        prefilled = decoder.prefill_cache()
        first = prefill(model, prompt, prefilled)[:, -1].argmax(-1)
        decoder.load(prefilled)
        fast = decoder.decode(first, 12, 48)
    assert isinstance(decoder.store, ToyStore) and decoder.columns()["kv_format"] == ToyStore.kv_format
    assert torch.equal(ref, fast), "the engines attend the same dequantized K/V"
    stats = cache_stats(cache)
    assert stats["physical_tokens"] == 48 + 11
    assert decoder.stats(12)["bytes"] == stats["bytes"]  # codes and scales, counted alike
    spec = loaded.spec
    scales = 2 * 2 * spec.num_layers * spec.num_kv_heads * 4  # float32 K and V scale per (row, head, layer)
    assert storage_bytes(policy.storage(), spec, [48] * spec.num_layers, 11, batch=2) == stats["bytes"] - scales


def test_budget_math_and_paged_layout(toy):
    storage = make_policy(toy).storage()
    spec = get_spec("llama-3.1-8b")
    per_token = 2 * spec.num_kv_heads * spec.head_dim * 2
    assert storage_bytes(storage, spec, [1000] * spec.num_layers, 24) == 1024 * per_token * spec.num_layers
    assert storage.paged(spec.num_kv_heads, spec.head_dim).block_bytes == 16 * per_token
    assert storage_blocks(storage, spec, [1000] * spec.num_layers, 24, batch=3) == 3 * 64 * spec.num_layers
    with pytest.raises(PolicyError, match="block must be >= 1"):
        make_policy(toy, block=0)


def test_generate_and_a_sweep_run_it(toy, capsys, tmp_path):
    args = ["generate", "--model", "tiny-llama", "--weights", "synthetic", "--prompt-tokens", "40",
            "--max-new-tokens", "4", "--method", toy, "--json"]
    for engine in ("hf", "fast"):
        assert main([*args, "--engine", engine]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["method"] == toy and len(out["token_ids"]) == 4
        assert out["cache_after_prefill"]["physical_tokens"] == 40
    params = parse_params({"models": "tiny-llama", "weights": "synthetic", "device": "cpu", "methods": [toy],
                           "engine": ["hf", "fast"], "ctx": [32], "batch": 1, "new_tokens": 3, "prompts": 1,
                           "repeats": 1, "threads": 1})
    run_sweep(params, tmp_path, progress=False, log=lambda m: None)
    records = list(read_jsonl(tmp_path / "records.jsonl"))
    assert {r["engine"] for r in records} == {"hf", "fast"}
    assert all(r["status"] == "ok" and r["method"] == toy for r in records), [r.get("error") for r in records]
    fast: dict[str, Any] = next(r for r in records if r["engine"] == "fast")
    assert fast["kv_format"] == ToyStore.kv_format
