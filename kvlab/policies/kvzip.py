"""KVzip: query-agnostic scores from how much the model attends to each context position when it is
asked to repeat the context (kvpress ``KVzipPress`` at 0.5.5, arXiv 2505.23416).

Rule: after the prompt's prefill (kept whole), the context is cut into chunks of ``chunk_size``
tokens; for each chunk the model runs a forward over ``repeat prompt + chat suffix + chunk`` on top
of the cached context (positions continue after the prompt; these K/V are dropped afterwards). In
every layer the repeat queries (post-RoPE) attend, softmax over [the ``n_sink`` first keys, the
chunk's keys in the cache, the repeat keys causally], scaled by 1/sqrt(head_dim); a context
position's score is the max of that attention over the repeat queries and the query heads of its
KV group. Once every chunk is scored, the first ``n_sink`` positions score the largest score over
every layer, row and head plus 1 (kvpress 0.5.5's ``compress_post``), above any attention weight, so
chunk 0's attention never demotes them. Chunk ``i > 0``'s
prompt is "Repeat the part of the previous context exactly, starting with" + the previous
chunk's last ``prev_postfix_size`` tokens; chunk 0's is "Repeat the previous context exactly.".
The strings and the chat suffix come from the model's tokenizer (found at
``config.name_or_path``); a model without one (synthetic weights) repeats the bare chunk.

Selection: each layer keeps its ``floor(n x keep)`` top positions per KV head (the ScorerPress
rule). kvpress's KVzip instead spreads the budget over heads and layers (``layerwise=False``: one
top-k over every layer and head) through masked keys; per head inside each layer is
``adakv(scorer=kvzip, alpha_safeguard=0)``, which is kvpress's ``layerwise=True``.

Cost: the reconstruction forwards run inside the prefill call (a forward hook on the decoder), so
TTFT and prefill energy include them: one forward per chunk (per row group with the fast engine's
``prefill_rows``), the prompt's tokens again plus the repeat prompts, each chunk's queries over the
whole cached prompt (about twice a causal prefill's attention), plus the float32 scoring (a
``q x (chunk + q)`` attention per chunk and layer). The repeat forwards attend lower-right causal
with no mask (:func:`reconstruction_forward`): with transformers' explicit mask they repeated every
K/V head per query head and kept SDPA off flash on CUDA. On CPU, where SDPA takes masks, this changed
little: benchmarks/kvzip_cost.py on SmolLM2 (2 shared cores) measures 3.4x a full prefill at 4k in
chunks of 512 and 4-8x in chunks of 2048 (the float32 scoring alone is 1.7-3.7x there; on a small
model attention, which the reconstruction does 2.5x of, is half the prefill).

kvpress also leaves the first ``prefix_length`` tokens (the chat template's system/user header it
inserts) unscored; kvlab's prompts are plain token ids, so scoring starts at 0.

A cleaner shared hook: the prefill entry points (``kvlab.engine.generation.prefill_once`` and ``prefill``,
the fast engine) could call ``policy.after_prefill(model, ids, cache)``, which would replace the
forward hook and the ids it records.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cache as memoize

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.cache_utils import DynamicLayer

from kvlab.policies.base import PolicyError, check_int, hf_model
from kvlab.policies.cache import EvictionError
from kvlab.policies.eviction import EvictionPolicy
from kvlab.policies.mixed import mixed_cache
from kvlab.storage import attention

FIRST_PROMPT = "\n\nRepeat the previous context exactly."
LATER_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
RECONSTRUCTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
SCORE_BLOCK_BYTES = {"cpu": 64 * 2**20, "cuda": 512 * 2**20}  # float32 logits scored at a time, per device type


def score_rows(bsz: int, n_heads: int, cols: int, device_type: str = "cuda") -> int:
    """Repeat queries scored at a time: one block's float32 logits ``[B, Hq, rows, cols]`` within
    ``SCORE_BLOCK_BYTES`` whatever the batch. On CUDA a large block (few launches) that still bounds the
    transient: a fixed 512 rows held 4.3 GB per block at batch 16 and 16k, three such tensors at once. On
    CPU 64 MiB: 1.1-1.4x faster than 512 MiB at SmolLM2's head shape on 2 cores (cache-sized 4 MiB
    blocks were 2x faster on idle cores but 3-5x slower on cores other jobs share: many small ops).
    Rows are independent, so the block size never changes a score."""
    budget = SCORE_BLOCK_BYTES.get(device_type, SCORE_BLOCK_BYTES["cuda"])
    return max(1, budget // (4 * bsz * n_heads * cols))


def kvzip_chunk_scores(query: torch.Tensor, keys: torch.Tensor, start: int, end: int, n_sink: int) -> torch.Tensor:
    """Scores of context positions ``start..end-1`` from one reconstruction forward, pure torch.

    ``query`` ``[B, Hq, q, D]`` (post-RoPE, the repeat tokens), ``keys`` ``[B, Hkv, n + q, D]`` (the
    cached context, then the repeat tokens). Returns ``[B, Hkv, end - start]``."""
    bsz, n_heads, q_len, dim = query.shape
    n_kv = keys.shape[1]
    groups = n_heads // n_kv
    sink = min(n_sink, start)
    sub = torch.cat([keys[:, :, :sink], keys[:, :, start:end], keys[:, :, -q_len:]], dim=2).float()
    ctx = end - start
    q = query.float().view(bsz, n_kv, groups, q_len, dim)
    step = score_rows(bsz, n_heads, sub.shape[2], keys.device.type)
    best = None
    for r0 in range(0, q_len, step):
        r1 = min(q_len, r0 + step)
        # div_ rounds as ``/`` does, without a second logits-sized transient
        logits = torch.einsum("bhgqd,bhkd->bhgqk", q[:, :, :, r0:r1], sub).div_(math.sqrt(dim))
        rows = torch.arange(r0, r1, device=keys.device)[:, None]
        cols = torch.arange(q_len, device=keys.device)[None, :]
        logits[..., -q_len:].masked_fill_(cols > rows, float("-inf"))
        probs = torch.softmax(logits, dim=-1)[..., sink:sink + ctx]
        del logits
        block = probs.amax(dim=(2, 3))
        best = block if best is None else torch.maximum(best, block)
    return best


@memoize
def repeat_prompts(name_or_path: str) -> tuple[list[int], list[int], list[int]]:
    """(first chunk's prompt ids, later chunks' prompt ids, chat suffix ids) from the tokenizer at
    ``name_or_path`` as kvpress derives them; three empty lists when there is no tokenizer."""
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
    except Exception:  # noqa: BLE001 - synthetic models have no tokenizer: repeat the bare chunk
        return [], [], []
    if tokenizer.chat_template is None:
        suffix = "\n"
    else:
        dummy = "dummy context"
        separator = "\n" + "#" * len(dummy)
        text = tokenizer.apply_chat_template([{"role": "user", "content": dummy + separator}],
                                             add_generation_prompt=True, tokenize=False, enable_thinking=False)
        suffix = text.split(separator)[1]

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    return encode(FIRST_PROMPT), encode(LATER_PROMPT), encode(suffix)


def reconstruction_inputs(ids: torch.Tensor, prompts, chunk_size: int, postfix: int):
    """``[(start, end, repeat ids [B, q])]`` per context chunk (kvpress ``KVzipPress.prepare``)."""
    first, later, suffix = (torch.tensor(p, dtype=ids.dtype, device=ids.device).expand(ids.shape[0], -1)
                            for p in prompts)
    out = []
    for start in range(0, ids.shape[1], chunk_size):
        end = min(ids.shape[1], start + chunk_size)
        head = first if start == 0 else torch.cat([later, ids[:, max(0, start - postfix):start]], dim=1)
        out.append((start, end, torch.cat([head, suffix, ids[:, start:end]], dim=1)))
    return out


class ReconstructionMixin:
    """An evicting layer that keeps the whole prompt, then scores it during the reconstruction
    forwards (:func:`score_by_reconstruction`) and evicts once they are done."""

    def _clear_eviction(self) -> None:
        super()._clear_eviction()
        self.kvzip_scores: torch.Tensor | None = None
        self._span: tuple[int, int] | None = None  # the context chunk being reconstructed
        self._scoring_keys: torch.Tensor | None = None

    def _prefill(self, new_keys, new_values):
        """Keep every prompt row (the scores need the whole prompt); evict in :meth:`finish_scoring`."""
        if not self.is_initialized:
            DynamicLayer.lazy_initialization(self, new_keys, new_values)
        keys, values = new_keys, new_values
        if self._staged is not None:
            keys = torch.cat([self._staged[0], new_keys], dim=-2)
            values = torch.cat([self._staged[1], new_values], dim=-2)
            self._staged = None
        self._batch_heads = tuple(keys.shape[:2])
        self.prompt_length = self.logical_length = self.logical_length + new_keys.shape[-2]
        self._keep(keys, values, None)
        return keys, values

    @property
    def pending(self) -> bool:
        """The whole prompt is in and has not been scored yet."""
        return self.prompt_length is not None and not self._streaming and self.kvzip_scores is None

    def begin_scoring(self) -> None:
        bsz, heads = self._batch_heads
        self.kvzip_scores = torch.zeros(bsz, heads, self.prompt_length, device=self.keys.device)

    def protect_sinks(self, top: torch.Tensor) -> None:
        """The first ``n_sink`` positions score ``top + 1`` (``top``: the largest score of every layer)."""
        self.kvzip_scores[..., : self.policy.n_sink] = top + 1.0

    def update(self, key_states, value_states, *args, **kwargs):
        if self._span is None:
            return super().update(key_states, value_states, *args, **kwargs)
        keys = torch.cat([self.keys, key_states], dim=-2)  # attended to, never stored
        values = torch.cat([self.values, value_states], dim=-2)
        self._scoring_keys = keys
        attention.expect_queries(self.layer_idx, self)
        return keys, values

    def awaits(self, key: torch.Tensor) -> bool:
        if self._span is not None:
            return self._scoring_keys is key
        return super().awaits(key)

    def receive_queries(self, query, attention_mask, scaling) -> None:
        if self._span is None:
            return super().receive_queries(query, attention_mask, scaling)
        start, end = self._span
        self.kvzip_scores[..., start:end] = kvzip_chunk_scores(query, self._scoring_keys, start, end,
                                                               self.policy.n_sink)
        self._scoring_keys = None
        return None

    def finish_scoring(self) -> None:
        """Evict to the budget with the reconstruction scores."""
        n = self.prompt_length
        n_kept = min(n, self.policy.budget(n, self.layer_idx, self.num_layers))
        if n_kept < self.keys.shape[-2] or hasattr(self, "select_heads"):  # a planned layer may keep more
            self._evict(self.keys, self.values, n_kept, self.kvzip_scores, None)


def reconstruction_forward(base_model, cache, repeat: torch.Tensor, start: int, cache_key: str) -> None:
    """One reconstruction forward: ``repeat`` ``[B, q]`` at positions ``start..`` over the cached prompt.

    The repeat tokens see the whole cached prompt and each other causally: lower-right causal
    attention, which :func:`kvlab.storage.attention.lower_right_chunks` runs with no mask. Without
    it transformers builds a ``[B, 1, q, n + q]`` mask, repeats every K/V head per query head (SDPA
    takes grouped heads only without a mask on CUDA) and keeps SDPA off flash (efficient or math on
    CUDA; "No available kernel" under a flash pin on the H200). The other backends stay open
    for inputs flash cannot take (float32 on CUDA)."""
    positions = torch.arange(start, start + repeat.shape[1], device=repeat.device).expand(repeat.shape[0], -1)
    with torch.no_grad(), sdpa_kernel(RECONSTRUCTION_BACKENDS), attention.lower_right_chunks(base_model):
        base_model(input_ids=repeat, position_ids=positions, use_cache=True, **{cache_key: cache})


def _layers(cache) -> list:
    return [layer for layer in getattr(cache, "layers", []) if isinstance(layer, ReconstructionMixin)]


def score_by_reconstruction(base_model, cache, ids: torch.Tensor, policy, cache_key: str) -> None:
    """Run kvpress's reconstruction forwards over ``cache`` (the prompt ``ids`` prefilled into it;
    ``cache_key``: the keyword the decoder takes it by), then evict every KVzip layer."""
    layers = _layers(cache)
    config = base_model.config
    prompts = repeat_prompts(getattr(config, "name_or_path", "") or "")
    n = ids.shape[1]
    for layer in layers:
        layer.begin_scoring()
    try:
        for start, end, repeat in reconstruction_inputs(ids, prompts, policy.chunk_size, policy.prev_postfix_size):
            for layer in layers:
                layer._span = (start, end)
            reconstruction_forward(base_model, cache, repeat, n, cache_key)
            missing = [layer.layer_idx for layer in layers if layer._scoring_keys is not None]
            if missing:
                raise EvictionError(f"kvzip: layers {missing} got no queries in the reconstruction forward: "
                                    f"call policy.prepare(model) before the first forward")
    finally:
        for layer in layers:
            layer._span = None
    top = torch.stack([layer.kvzip_scores.amax() for layer in layers]).amax()
    for layer in layers:
        layer.protect_sinks(top)
    plan = getattr(cache, "plan_heads", None)
    if plan is not None:  # budgets across layers (adakv scope='model'): every layer's scores are in
        plan(layers)
    for layer in layers:
        layer.finish_scoring()


def _after_forward(module, args, kwargs, output):
    """Forward hook on the decoder: once a KVzip cache holds a whole prompt, score and evict it."""
    cache_key = "cache" if kwargs.get("cache") is not None else "past_key_values"
    cache = kwargs.get(cache_key)
    layers = _layers(cache)
    if not layers or any(layer._span is not None for layer in layers):
        return None  # not a KVzip cache, or a reconstruction forward itself
    ids = kwargs.get("input_ids")
    if ids is None:
        raise EvictionError("kvzip scores by reconstructing the prompt's tokens: prefill with input_ids")
    seen = getattr(cache, "kvzip_ids", None)
    if layers[0].pending or layers[0]._streaming:
        cache.kvzip_ids = ids if seen is None else torch.cat([seen, ids], dim=1)
    if layers[0].pending:
        score_by_reconstruction(module, cache, cache.kvzip_ids, cache.policy_for_scoring, cache_key)
        cache.kvzip_ids = None
    return None


def decoder_of(model):
    inner = hf_model(model)
    return getattr(inner, "model", inner)


def install_reconstruction(model) -> None:
    """The decoder's forward hook that runs the reconstruction (idempotent, inert for other caches)."""
    decoder = decoder_of(model)
    if not getattr(decoder, "_kvlab_kvzip_hook", False):
        decoder.register_forward_hook(_after_forward, with_kwargs=True)
        decoder._kvlab_kvzip_hook = True


@dataclass(frozen=True)
class KVzipPolicy(EvictionPolicy):
    name = "kvzip"
    summary = "query-agnostic: attention received while the model repeats the context (about 2 prefills)"
    needs_attention = True  # the reconstruction forwards hand their queries over

    n_sink: int = field(default=4, metadata={"help": "first positions always kept"})
    chunk_size: int = field(default=2048, metadata={"help": "context tokens reconstructed per forward"})
    prev_postfix_size: int = field(default=8, metadata={"help": "previous chunk's last tokens quoted in the prompt"})

    def __post_init__(self):
        super().__post_init__()
        check_int("n_sink", self.n_sink, minimum=0)
        check_int("chunk_size", self.chunk_size, minimum=1)
        check_int("prev_postfix_size", self.prev_postfix_size, minimum=0)
        if self.quant is not None:
            raise PolicyError("kvzip with quant is not supported yet: it keeps the prompt unquantized until scored")

    def score(self, keys, values, attn, layer_idx):
        return attn  # the reconstruction scores, [B, Hkv, n]

    def layer_mixins(self) -> tuple[type, ...]:
        return (ReconstructionMixin,)

    def prepare(self, model) -> None:
        super().prepare(model)
        install_reconstruction(model)

    def make_cache(self, model):
        return self.bind(mixed_cache(self, model, self.layer_mixins()))

    def bind(self, cache):
        """Mark ``cache`` as one the decoder hook scores with this policy's knobs."""
        cache.policy_for_scoring = self
        return cache
