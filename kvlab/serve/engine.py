"""The serving engine: requests in, token events out, one scheduler iteration per step.

The HTTP server and the traffic driver both speak only this: ``add`` a :class:`Request`, call
``step`` until ``has_work`` is false, read :class:`TokenEvent` s (each with its time on the engine's
clock, ``time.perf_counter`` based), ``abort`` a request to free its blocks. A step is: schedule
(:mod:`kvlab.serve.scheduler`), one forward over every scheduled chunk
(:mod:`kvlab.serve.forward`), evict the prompts that just finished prefilling (an evicting method:
survivors compacted into the first blocks, the rest freed), then one greedy token per request
whose chunk reached its last token.
"""

from __future__ import annotations

import time

import torch

from kvlab.serve.forward import Chunk, PagedForward
from kvlab.serve.layout import BlockLayout
from kvlab.serve.methods import layout_for, make_method, make_pool
from kvlab.serve.pool import BlockAllocator, slots_of
from kvlab.serve.request import Request, ServeError, TokenEvent
from kvlab.serve.scheduler import Scheduler, Sequence

__all__ = ["Request", "TokenEvent", "ServeError", "ServingEngine", "make_serving_engine"]

ENGINE_KEYS = ("num_blocks", "max_num_seqs", "max_num_batched_tokens", "reserve_gb", "attention")
ATTENTION = ("reference", "triton")


class ServingEngine:
    """Continuous batching over a block pool (see the module docstring)."""

    def __init__(self, loaded, policy, layout: BlockLayout, num_blocks: int, *,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 2048, attention: str | None = None):
        if num_blocks < 1:
            raise ServeError(f"the pool holds {num_blocks} blocks of {layout.bytes_per_block} B: give it more memory "
                             f"(pool_gb) or fewer layers")
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ServeError("max_num_seqs and max_num_batched_tokens must be >= 1")
        model = loaded.model
        self.loaded, self.policy, self.layout = loaded, policy, layout
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.spec.name
        dtype = next(model.parameters()).dtype
        # one spare block past the allocator's: a captured decode step's padding rows write there
        self.pool = make_pool(policy, loaded.spec, num_blocks + 1, layout.block_size, dtype, loaded.device)
        self.allocator = BlockAllocator(num_blocks)
        self.scheduler = Scheduler(layout, self.allocator, max_num_seqs, max_num_batched_tokens)
        if attention is None:  # the paged kernel where it runs compiled: CUDA, a pool that has one
            attention = "triton" if str(loaded.device).startswith("cuda") and self.pool.paged_kernel else "reference"
        if attention not in ATTENTION or (attention == "triton" and not self.pool.paged_kernel):
            raise ServeError(f"attention={attention!r}: use 'reference' (any store) or 'triton' (the paged kernels: "
                             f"the pools that have one, at a head dim their kernels read: {type(self.pool).__name__} has none here)")
        self.attention = attention
        self.max_model_len = min(loaded.spec.max_context, num_blocks * layout.block_size)
        self.runner = PagedForward(model, self.pool, layout.block_size, attention,
                                   max_blocks=layout.blocks_for(self.max_model_len), spare_block=num_blocks)
        self.eos_id = getattr(self.tokenizer, "eos_token_id", None)
        self.seqs: dict[str, Sequence] = {}
        self.finished: dict[str, dict] = {}  # request id -> what the engine knows of it (records read it)
        self.timeline: list[dict] = []  # one row per step: time, running, waiting, blocks and slots in use

    # -- the contract -----------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        n, new = len(request.prompt_ids), request.max_new_tokens
        if n < 1 or new < 1:
            raise ServeError(f"request {request.request_id}: needs a prompt and max_new_tokens >= 1 "
                             f"(got {n} prompt tokens, {new} new)")
        if request.request_id in self.seqs:
            raise ServeError(f"request id {request.request_id!r} is already in the engine: use a new id")
        need = self.layout.peak_blocks(n, new)
        if n + new > self.max_model_len or need > self.allocator.total:
            raise ServeError(f"request {request.request_id}: {n} prompt + {new} new tokens need {need} blocks of "
                             f"{self.layout.block_size} and the pool holds {self.allocator.total} "
                             f"(max_model_len {self.max_model_len}): shorten it or give the pool more memory")
        seq = Sequence(request)
        self.seqs[request.request_id] = seq
        self.scheduler.waiting.append(seq)

    def abort(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.scheduler.finish(seq)
            self.finished[request_id] = self.summary(seq, "abort")

    def warm_up(self, prompt_len: int = 16) -> None:
        """Compile and capture before any clock starts (vLLM captures at startup too): every decode
        graph a batch of up to ``max_num_seqs`` replays, then one short request through prefill and
        decode. It leaves no trace: its blocks are freed, its summary and timeline rows dropped."""
        if self.runner.graphs is not None:
            self.runner.graphs.capture_upto(self.scheduler.max_num_seqs)
        rid = "kvlab-warm-up"
        n = max(1, min(prompt_len, self.max_model_len - 2))
        self.add(Request(rid, [0] * n, 2, time.perf_counter()))
        while self.has_work():
            self.step()
        self.finished.pop(rid, None)
        self.timeline.clear()

    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    def stats(self) -> dict:
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "blocks_used": self.allocator.used, "blocks_free": self.allocator.free,
                "blocks_total": self.allocator.total, "preemptions_total": self.scheduler.preemptions_total,
                "slots_filled": sum(s.stored for s in self.scheduler.running)}

    def step(self) -> list[TokenEvent]:
        began = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch:
            return []
        now = time.perf_counter()
        chunks = [self.chunk(seq, n, now) for seq, n in batch]
        logits = self.runner.forward(chunks)
        if logits.is_cuda:  # the forward's own time, not its launches (the tokens below wait for it anyway)
            torch.cuda.synchronize(logits.device)
        forward_s = time.perf_counter() - now  # the rest of the step is bookkeeping (and the eviction)
        events = []
        for (seq, n), chunk, row in zip(batch, chunks, logits, strict=True):
            seq.fed += n
            seq.stored += n
            if chunk.observe_from is not None:
                seq.window.append(chunk.queries)
            if self.layout.evicts and not seq.compressed and seq.fed == seq.prompt_len:
                self.evict(seq, chunk)
            if seq.fed == len(seq.tokens):
                events.append(self.emit(seq, int(row.argmax())))
        ended = time.perf_counter()
        self.timeline.append({"time_s": ended, **self.stats(), "tokens": sum(n for _, n in batch),
                              "step_s": ended - began, "forward_s": forward_s})
        return events

    # -- inside a step ----------------------------------------------------------------------------
    def chunk(self, seq: Sequence, n: int, now: float) -> Chunk:
        if seq.first_scheduled_s is None:
            seq.first_scheduled_s = now
        observe = None
        if self.layout.evicts and not seq.compressed:
            window_start = seq.prompt_len - min(self.layout.window, seq.prompt_len)
            if seq.fed + n > window_start:
                observe = max(0, window_start - seq.fed)
        return Chunk(seq.blocks, seq.tokens[seq.fed:seq.fed + n], seq.fed, seq.stored, observe,
                     decode_from=max(0, seq.prompt_len - seq.fed))

    def evict(self, seq: Sequence, chunk: Chunk) -> None:
        """The prompt's selection, each KV head's survivors compacted into the first blocks."""
        n_layers = len(chunk.queries)
        prompt = slots_of(seq.blocks, 0, seq.prompt_len, self.layout.block_size)
        kept_n = self.layout.resident_tokens(seq.prompt_len)
        target = slots_of(seq.blocks, 0, kept_n, self.layout.block_size)
        scale = self.runner.step.scaling
        for layer in range(n_layers):
            q = torch.cat([part[layer] for part in seq.window], dim=1)  # [Hq, w, D]
            keys, values = self.pool.read(layer, prompt)  # [Hkv, P, D]
            attn = window_attention(q, keys, scale)
            kept = self.policy.select(keys[None], values[None], attn, kept_n, layer, n_layers)[0]  # [Hkv, k]
            idx = kept.unsqueeze(-1).expand(-1, -1, keys.shape[-1])
            self.pool.write(layer, target, keys.gather(1, idx).transpose(0, 1), values.gather(1, idx).transpose(0, 1))
        seq.window = []
        seq.stored, seq.compressed = kept_n, True
        self.scheduler.shrink(seq)

    def emit(self, seq: Sequence, token: int) -> TokenEvent:
        seq.output.append(token)
        request = seq.request
        reason = None
        if len(seq.output) >= request.max_new_tokens:
            reason = "length"
        elif not request.ignore_eos and token == self.eos_id:
            reason = "stop"
        if reason:
            self.scheduler.finish(seq)
            del self.seqs[request.request_id]
            self.finished[request.request_id] = self.summary(seq, reason)
        return TokenEvent(request.request_id, token, time.perf_counter(), reason is not None, reason)

    def summary(self, seq: Sequence, reason: str) -> dict:
        return {"finish_reason": reason, "preemptions": seq.preemptions, "recomputed_tokens": seq.recomputed_tokens,
                "peak_blocks": seq.peak_blocks, "first_scheduled_s": seq.first_scheduled_s,
                "resident_blocks": self.layout.blocks_for(self.layout.resident_tokens(seq.prompt_len)
                                                          + len(seq.output))}


def window_attention(q: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """The last ``w`` prompt queries' causal attention over the prompt's keys, ``[1, Hq, w, P]`` float32."""
    hq, w, _ = q.shape
    n = keys.shape[1]
    k = keys.repeat_interleave(hq // keys.shape[0], dim=0).float()
    scores = torch.einsum("hwd,hnd->hwn", q.float(), k) * scale
    mask = torch.ones(w, n, dtype=torch.bool, device=q.device).tril(n - w)
    return scores.masked_fill(~mask, float("-inf")).softmax(-1).unsqueeze(0)


def make_serving_engine(model, method: str, *, pool_gb=None, block_size=16, device="cpu",
                        **policy_params) -> ServingEngine:
    """A serving engine over ``model`` (a ``LoadedModel`` or a model name to load) for ``method``.

    The pool holds ``pool_gb`` GB of blocks (``num_blocks=`` sets the count instead); on CUDA without
    either, the GPU's free memory after the weights minus ``reserve_gb`` (default 2) for activations and
    minus what ``max_num_seqs`` requests hold outside their blocks (a storage's bf16 tails; with ``pool_gb``
    those are outside the pool).
    ``max_num_seqs`` and ``max_num_batched_tokens`` go to the scheduler; other keywords are the
    method's policy parameters (``keep=0.25`` for snapkv).
    """
    engine_opts = {k: policy_params.pop(k) for k in ENGINE_KEYS if k in policy_params}
    policy = make_method(method, policy_params)
    if isinstance(model, str):
        from kvlab.models import load_model

        model = load_model(model, device=device)
    dtype = next(model.model.parameters()).dtype
    layout = layout_for(policy, model.spec, dtype, block_size, str(model.device).startswith("cuda"))
    num_blocks = engine_opts.pop("num_blocks", None)
    reserve_gb = engine_opts.pop("reserve_gb", 2.0)
    if num_blocks is None:  # sized from the GPU's free memory: the requests' bytes outside blocks come off first
        outside = 0 if pool_gb is not None else engine_opts.get("max_num_seqs", 256) * layout.sequence_bytes
        num_blocks = layout.pool_blocks(pool_bytes(pool_gb, model.device, reserve_gb) - outside)
    return ServingEngine(model, policy, layout, int(num_blocks), **engine_opts)


def pool_bytes(pool_gb, device, reserve_gb: float) -> float:
    if pool_gb is not None:
        if pool_gb <= 0:
            raise ServeError(f"pool_gb={pool_gb} must be > 0 (GB of KV blocks)")
        return pool_gb * 1e9
    if str(device).startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return free - reserve_gb * 1e9
    raise ServeError("on CPU the pool needs a size: pass pool_gb= (GB of KV blocks) or num_blocks=")
