"""The fast engine: static KV buffers and one CUDA-graph replay per decode step.

    engine = FastEngine(loaded)                         # once per loaded model
    decoder = engine.decoder(policy, batch, ctx, n)     # sized and captured once per shape (warm-up)
    cache = decoder.prefill_cache()                     # full/quantized: the store itself (StoreCache);
                                                        # evicting: the policy's cache, unquantized
    logits = generation.prefill(model, ids, cache)      # eviction happens here, as on ``hf``
    decoder.load(cache)                                 # kept K/V -> static buffers (a copy if evicting)
    tokens = decoder.decode(first, n, start_position=ctx, on_step=...)

    first = decoder.prefill(ids, chunk, rows=4)         # the three middle lines, 4 sequences at a time
    logits = decoder.feed(question, start)              # teacher forcing through the store (eager steps)

The decode loop (``FastDecoder.decode``) reads top to bottom: set the first token, then replay the
graph ``n - 1`` times. The graph holds the whole step: embedding, every layer (the model's own
modules, kvlab's attention over the static store), the LM head, argmax, and the writes of the new
token into the token tensor and the output row; ``step`` and ``position`` advance on the device. On
CPU the same step runs eagerly, which is what the tests compare with ``hf`` token for token.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from kvlab.anatomy import Anatomy
from kvlab.columns import engine_columns
from kvlab.engine import EngineError, prefill_rows
from kvlab.engine.anatomy import fast_anatomy
from kvlab.engine.generation import chunk_bounds, prefill
from kvlab.engine.llama import LlamaFamilyStep, check_model
from kvlab.policies.base import hf_model
from kvlab.policies.full import FullPolicy
from kvlab.storage.base import Storage, StoreOptions
from kvlab.storage.slots import DENSE_ATTENTION, Layout, flash_takes_splits

CAPTURE_WARMUP_STEPS = 3
# How the step is compiled by default, per device type (:data:`kvlab.engine.llama.STEP_COMPILE`).
# On the H200 (Llama-3.1-8B shape, 16k, batch 1) the compiled layers inside kvlab's own graph took
# 5.60 ms/step against 6.71 eager-in-graph and 10.10 for mode="reduce-overhead" over the whole step
# (reports/); compiling costs ~7 s once per engine. CPU steps stay eager (the
# reference the tests compare with transformers).
DEFAULT_COMPILE = {"cuda": "layers"}


class FastDecoder:
    """Static buffers + the captured step for one layout (batch, kept tokens per layer, new tokens)."""

    cache = None  # decode runs in the static store, not in a transformers cache

    def __init__(self, model, step: LlamaFamilyStep, store, layout: Layout, storage: Storage, device,
                 capture: bool):
        """``capture``: CUDA only. With ``step.compile == "reduce-overhead"`` the step is handed to
        ``torch.compile(mode="reduce-overhead")`` (torch's CUDA graph trees) instead of captured here."""
        self.model = model
        self.step_fn = step
        self.store = store
        self.layout = layout
        self.storage = storage
        self.device = torch.device(device)
        bsz = layout.batch
        self.token = torch.zeros(bsz, 1, dtype=torch.long, device=device)
        self.position = torch.zeros(bsz, 1, dtype=torch.long, device=device)
        self.tokens = torch.zeros(bsz, layout.new_tokens + 1, dtype=torch.long, device=device)
        self.fed = 0  # tokens fed through the store since the load (:meth:`feed`); decode goes on after them
        self.graph = None
        self._compiled = None
        if capture and step.compile == "reduce-overhead":
            self._compile_step()
        elif capture:
            self._capture()

    # -- the step, as captured --------------------------------------------------------------
    def _step(self) -> None:
        logits = self.step_fn(self.token, self.position, self.store)
        # greedy token -> next input and output column step + 1 (a view from column 1: no index kernel)
        self.step_fn.record(logits, self.token, self.position, self.tokens[:, 1:], self.store.step)
        self.store.advance()

    @torch.no_grad()
    def _capture(self) -> None:
        """Warm up on a side stream (lazy inits, cuBLAS handles), then capture one step."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(CAPTURE_WARMUP_STEPS):
                self.store.step.zero_()  # every warm-up writes slot kept+0: fits any new_tokens >= 1
                self._step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step()
        torch.cuda.synchronize(self.device)
        self.graph = graph

    @torch.no_grad()
    def _compile_step(self) -> None:
        """The alternative to :meth:`_capture`: torch.compile's CUDA graphs over the same step. Every
        buffer the step writes is marked static, so the graph trees may replay in place."""
        for t in (self.token, self.position, self.tokens, *self.store.buffers()):
            torch._dynamo.mark_static_address(t)
        self._compiled = torch.compile(self._step, mode="reduce-overhead")
        for _ in range(CAPTURE_WARMUP_STEPS):
            self.store.step.zero_()
            self._compiled()
        torch.cuda.synchronize(self.device)

    @property
    def replays(self) -> bool:
        """Whether steps are graph replays (kvlab's own capture or torch.compile's), not eager ops."""
        return self.graph is not None or self._compiled is not None

    # -- a generation ------------------------------------------------------------------------
    def prefill_cache(self, rows: slice | None = None):
        """A fresh transformers cache to prefill (batch rows ``rows`` of the store; None: all) into,
        the storage's: the store itself where the prompt enters whole and the store takes its writes
        (no second copy of the prompt's K/V at the peak), else a cache :meth:`load` copies from (an
        evicting policy's own, unquantized: it selects from the whole prompt's K/V)."""
        return self.storage.prefill_cache(self.store, rows, self.model)

    def load(self, cache, rows: slice | None = None) -> None:
        """Move the prefilled cache's kept K/V into the static buffers (a copy, inside prefill):
        into batch rows ``rows`` when the cache holds a group of the batch's sequences. A cache that
        wrote into the store already is only checked."""
        self.storage.load(self.store, cache, rows)
        self.logical_tokens = int(cache.get_seq_length())
        self.fed = 0

    @torch.no_grad()
    def feed(self, input_ids: torch.Tensor, start_position: int | torch.Tensor) -> torch.Tensor:
        """Teacher forcing through the store: ``input_ids [B, n]`` one step at a time at positions
        ``start_position, ...``, each written into the store in its format (quantized on write, as a
        decoded token is) and attending what the store holds; the logits ``[B, n, V]`` (float32).

        A question appended after the context, or a gold answer, so sees the same stored context as
        the greedy reply does (the transformers prefill cache is exact; the store is the format).
        Eager steps (no graph); :meth:`decode` goes on after the fed tokens."""
        ids = torch.as_tensor(input_ids, device=self.device).reshape(self.layout.batch, -1)
        n = ids.shape[1]
        if self.fed + n > self.layout.new_tokens:
            raise EngineError(f"this decoder has room for {self.layout.new_tokens} tokens after the prefill: "
                              f"{self.fed} fed, {n} more asked")
        start = torch.as_tensor(start_position, device=self.device).reshape(-1, 1).expand(self.layout.batch, 1)
        out = []
        for j in range(n):
            self.store.step.fill_(self.fed)
            out.append(self.step_fn(ids[:, j:j + 1], start + j, self.store).float())
            self.fed += 1
        self.store.step.fill_(self.fed)
        return torch.stack(out, dim=1)

    def checkpoint(self) -> int | None:
        """A mark of what the store holds now (:meth:`restore` goes back to it): the tokens fed.
        Slots past the mark are overwritten by what is fed or decoded next and never attended before.
        None for a store that cannot go back (a ring of exact tokens, page bounds): the caller rebuilds."""
        return self.fed if self.store.rewinds else None

    def restore(self, mark: int) -> None:
        self.fed = mark
        self.store.step.fill_(mark)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, chunk: int | None = None, rows: int | None = None) -> torch.Tensor:
        """Prefill ``input_ids [B, n]`` through transformers into the static buffers; the first
        tokens ``[B, 1]`` (greedy, from the prefill's last logits).

        ``rows``: prefill that many sequences at a time (None: the whole batch at once). Each group
        gets a fresh :meth:`prefill_cache`, its kept K/V go into its rows of the store, and its cache is
        freed before the next group starts, so the peak holds one group's full-length prefill cache
        and activations instead of the batch's. Every policy the engine runs selects per sequence, so
        the tokens are those of the whole-batch prefill. ``chunk``: each group's prompt goes through
        in chunks of that many tokens (:func:`kvlab.engine.generation.prefill`).
        """
        firsts = []
        for start, stop in chunk_bounds(input_ids.shape[0], prefill_rows(rows, input_ids.shape[0])):
            cache = self.prefill_cache(slice(start, stop))
            logits = prefill(self.model, input_ids[start:stop], cache, chunk)
            firsts.append(logits[:, -1, :].argmax(dim=-1, keepdim=True))
            self.load(cache, slice(start, stop))
            del cache, logits  # before the next group's prefill: one group's cache at a time
        return torch.cat(firsts)

    @torch.no_grad()
    def decode(self, first_token: torch.Tensor, n_new: int, start_position: int | torch.Tensor,
               on_step: Callable[[int], Any] | None = None) -> torch.Tensor:
        """Greedy tokens ``[B, n_new]``: ``first_token`` then ``n_new - 1`` replays; EOS ignored.
        They follow the prefill and any tokens :meth:`feed` wrote since."""
        fed = self.fed
        if not 1 <= n_new <= self.layout.new_tokens - fed:
            raise EngineError(f"this decoder was sized for {self.layout.new_tokens} new tokens ({fed} fed), "
                              f"asked {n_new}")
        self.token.copy_(first_token.reshape(-1, 1))
        self.position.copy_(torch.as_tensor(start_position, device=self.device).reshape(-1, 1)
                            .expand_as(self.position))
        self.tokens[:, fed:fed + 1].copy_(self.token)
        self.store.step.fill_(fed)
        for i in range(n_new - 1):
            if self.graph is not None:
                self.graph.replay()
            elif self._compiled is not None:
                self._compiled()
            else:
                self._step()
            if on_step is not None:
                on_step(i)
        return self.tokens[:, fed:fed + n_new].clone()

    def stats(self, new_tokens: int = 0) -> dict[str, Any]:
        """Tokens held and their bytes, like ``policies.cache_stats`` (per layer mean): after the
        prefill, or after ``new_tokens`` generated (the last one is never written back) following
        the tokens fed (:meth:`feed`, e.g. a question), as ``hf`` reports its cache."""
        extra = self.fed + new_tokens - 1 if new_tokens > 0 else 0
        held = [k + extra for k in self.layout.kept]
        logical = getattr(self, "logical_tokens", None)
        return {"logical_tokens": None if logical is None else logical + extra,
                "physical_tokens": sum(held) // len(held) if len(set(held)) == 1 else sum(held) / len(held),
                "bytes": self.store.held_bytes(held),
                "bytes_allocated": self.store.bytes_allocated(),
                "kv_format": self.store.kv_format, "attention": self.store.attention,
                "graph": self.replays,
                "step_compile": self.step_fn.compile}

    def columns(self, prefill_rows: int | None = None) -> dict[str, Any]:
        """The engine's record columns: ``engine: fast``, ``prefill_rows`` and how the store held and
        attended the KV."""
        stats = self.stats()
        return {**engine_columns(FastEngine.name, prefill_rows), "kv_format": stats["kv_format"],
                "fast_attention": stats["attention"], "cuda_graph": stats["graph"],
                "fast_compile": stats.get("step_compile"), "cache_bytes_allocated": stats["bytes_allocated"]}


def check_flash_splits(splits: int | None) -> None:
    """``flash_splits`` is None or 1..128 (flash's own bound), on a torch whose flash op takes it."""
    if splits is None:
        return
    if not isinstance(splits, int) or not 1 <= splits <= 128:
        raise EngineError(f"flash_splits={splits!r}: use None (flash's heuristic) or a count from 1 to 128")
    if not flash_takes_splits():
        raise EngineError(f"flash_splits={splits}: torch {torch.__version__}'s flash attention op takes no "
                          f"num_splits (torch 2.13's does); use None")


class FastEngine:
    """Builds and keeps :class:`FastDecoder` s for one loaded model (captured graphs are reused).

    ``capture``: ``None`` = on CUDA only. ``attention``: the dense store's kernel (``auto``, ``flash``,
    ``sdpa``, ``cudnn``: cuDNN's attention over a length bias, opt-in until measured, or ``triton``:
    the cache in kvlab's bf16 format read by the same split-K kernel as the quantized formats, the
    like-for-like baseline of the fused kernels); ``quant_attention``: a
    quantized store's (``fused`` Triton kernel or ``dequantize`` then attend). ``compile``: how the
    step is compiled (:data:`~kvlab.engine.llama.STEP_COMPILE`; ``None``: :data:`DEFAULT_COMPILE`
    for the device). ``max_decoders`` bounds how many layouts keep their buffers and graphs alive at
    once (a sweep interleaves a shape's methods; each has its layout), and on CUDA so does
    ``keep_fraction``: the buffers kept alive for reuse, with the new layout's (counted as a dense
    cache), stay under that share of the device's memory (at batch 16 and 16k a full cache's buffers
    alone are 34 GB, so every other layout is dropped before one is built; a layout evicted here is simply
    built and captured again when next asked for, outside any measured window). ``flash_splits``: the
    dense store's flash split-KV count (None: flash's heuristic, 33 splits at batch 1 and 2 at batch
    16 on the H200 at 16k, each split's partial results then merged by a combine kernel: 0.33 ms of a
    5.65 ms step at batch 1); needs a torch whose flash op takes ``num_splits``. A knob to measure
    with (benchmarks/minimal_step.py ``--variants flash_splits=N``), not recorded in a run's columns.
    """

    name = "fast"
    kernel_backend = "auto"  # the storage kernels' ``StoreOptions.backend`` (``triton`` on CPU: the interpreter)

    def __init__(self, model, attention: str = "auto", capture: bool | None = None, max_decoders: int = 4,
                 quant_attention: str = "auto", keep_fraction: float = 0.25, compile: str | None = None,
                 flash_splits: int | None = None):
        if attention not in (*DENSE_ATTENTION, "triton"):
            raise EngineError(f"attention={attention!r}: use one of {', '.join((*DENSE_ATTENTION, 'triton'))}")
        check_flash_splits(flash_splits)
        self.flash_splits = flash_splits
        self.loaded = model
        self.model = hf_model(model)
        check_model(self.model)
        param = next(self.model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.step = LlamaFamilyStep(self.model, compile or DEFAULT_COMPILE.get(self.device.type, "none"))
        self.attention = attention
        self.quant_attention = quant_attention
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.max_decoders = max_decoders
        self.max_kept_bytes = (keep_fraction * torch.cuda.get_device_properties(self.device).total_memory
                               if self.device.type == "cuda" else None)
        self._decoders: OrderedDict[tuple, FastDecoder] = OrderedDict()

    def storage_policy(self, policy):
        """The policy whose transformers cache the prefill fills (and whose warm-up runs): its storage's
        prefill policy (an evicting policy, unquantized), else ``full`` (the prompt enters whole)."""
        return policy.storage().prefill or FullPolicy()

    def layout(self, policy, batch: int, ctx: int, new_tokens: int) -> Layout:
        return Layout(batch, tuple(policy.kept_tokens(ctx, self.step.num_layers)), new_tokens,
                      self.step.num_kv_heads, self.step.head_dim)

    def decoder(self, policy, batch: int, ctx: int, new_tokens: int) -> FastDecoder:
        """The decoder for a ``ctx``-token prompt, sized from the policy before any prefill (so a
        measured run captures its graph before its energy window opens)."""
        return self._decoder(self.layout(policy, batch, ctx, new_tokens), policy.storage())

    def decoder_for_cache(self, policy, cache, new_tokens: int,
                          prefill_stats: dict[str, Any] | None = None) -> FastDecoder:
        """A decoder holding whatever a prefilled cache (of :meth:`storage_policy`) holds, e.g. a
        context: sized from the cache, loaded from it, with room for ``new_tokens`` more (fed with
        :meth:`FastDecoder.feed`, e.g. a question, or decoded). Its stats are the store's
        (``prefill_stats`` is for ``hf``, unused here)."""
        storage = policy.storage()
        batch, kept = storage.kept(cache)
        layout = Layout(batch, kept, new_tokens, self.step.num_kv_heads, self.step.head_dim)
        decoder = self._decoder(layout, storage)
        decoder.load(cache)
        return decoder

    def _decoder(self, layout: Layout, storage: Storage) -> FastDecoder:
        key = (layout, repr(storage))
        if key in self._decoders:
            self._decoders.move_to_end(key)
            return self._decoders[key]
        while len(self._decoders) >= self.max_decoders:
            self._decoders.popitem(last=False)
        if self.max_kept_bytes is not None:
            # the new store counts too: at batch 16 and 16k a full store (34 GB) beside the kept stores of
            # the other methods and its own prefill cache ran out of the H200's memory
            new = layout.dense_bytes(self.dtype.itemsize)
            while self._decoders and sum(d.store.bytes_allocated() for d in self._decoders.values()) + new \
                    > self.max_kept_bytes:
                self._decoders.popitem(last=False)
            torch.cuda.empty_cache()
        store = storage.store(layout, StoreOptions(self.dtype, self.device, self.step.num_heads, self.step.scaling,
                                                   self.attention, self.quant_attention, self.flash_splits,
                                                   self.kernel_backend))
        decoder = FastDecoder(self.model, self.step, store, layout, storage, self.device, self.capture)
        self._decoders[key] = decoder
        return decoder

    def anatomy(self, policy, ctx: int, batch: int = 1, steps: int = 8, warmup: int = 2, seed: int = 0) -> Anatomy:
        """Where a decode step's time goes (:func:`kvlab.engine.anatomy.fast_anatomy`)."""
        return fast_anatomy(self, policy, ctx, batch, steps, warmup, seed)

    def release(self) -> bool:
        """Drop every kept decoder (buffers and graphs); True if there was one (memory to free)."""
        held = bool(self._decoders)
        self._decoders.clear()
        return held
