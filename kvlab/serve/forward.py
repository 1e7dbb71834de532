"""One forward over a batch of chunks, each a run of one request's tokens, reading K/V from blocks.

Every token is a row (as vLLM's flattened batch): the model's embedding, norms, fused projections
and MLP (``kvlab.engine.llama``'s functions over the loaded model's own weights) run once over all
rows; only attention is per request: each chunk writes its K/V into its request's slots and
attends, causally, over every slot its block table holds. A decode step is a chunk of one token;
a prefill chunk is many. The torch reference, the one a GPU kernel over block tables is checked
against.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvlab.engine.llama import LlamaFamilyStep, attention_inputs, layer_output, rms_norm, step_inputs
from kvlab.kernels.paged import paged_decode
from kvlab.serve.decode_graphs import DecodeGraphs
from kvlab.serve.pool import slots_of
from kvlab.storage.paged import attend


@dataclass
class Chunk:
    """``tokens`` of one request at logical positions ``start..``, stored after its ``stored`` slots.

    ``observe_from``: rows from which the post-RoPE queries are kept (an evicting method scores the
    prompt with its last window of queries); None keeps none. ``decode_from``: the first row past the
    prompt (a decode token, or a generated token re-fed after a preemption): a sparse read selects pages for those.
    """

    blocks: list[int]
    tokens: list[int]
    start: int
    stored: int
    observe_from: int | None = None
    decode_from: int = 0
    queries: list[torch.Tensor] = field(default_factory=list)  # per layer [Hq, w, D], filled by the forward


class PagedForward:
    """``forward(chunks) -> logits [len(chunks), V]`` of each chunk's last token."""

    def __init__(self, model, pool, block_size: int, attention: str = "reference", max_blocks: int = 0,
                 spare_block: int | None = None):
        self.step = LlamaFamilyStep(model)  # fused q/k/v and gate/up views of the model's own weights
        self.pool = pool
        self.block_size = block_size
        self.device = next(model.parameters()).device
        self.batch_decode = attention == "triton"  # decode tokens batched through the pool's paged kernel
        self.graphs = None
        if self.batch_decode and spare_block is not None and pool.captures_decode:
            # a step of decode tokens only: a CUDA graph per batch bucket
            self.graphs = DecodeGraphs(self.step, pool, block_size, max_blocks, spare_block, paged_decode)

    @torch.no_grad()
    def forward(self, chunks: list[Chunk]) -> torch.Tensor:
        if self.graphs is not None and all(len(c.tokens) == 1 and c.observe_from is None for c in chunks):
            bs = self.block_size
            return self.graphs.decode([c.tokens[0] for c in chunks], [c.start for c in chunks],
                                      [c.blocks[c.stored // bs] * bs + c.stored % bs for c in chunks],
                                      [c.blocks for c in chunks], [c.stored + 1 for c in chunks])
        s = self.step
        tokens = torch.tensor([t for c in chunks for t in c.tokens], device=self.device).unsqueeze(1)
        positions = torch.cat([torch.arange(c.start, c.start + len(c.tokens)) for c in chunks]).to(self.device)
        hidden, cos, sin = step_inputs(s.embed, s.rotary, tokens, positions.unsqueeze(1))  # [N, 1, H]
        bounds = torch.tensor([0] + [len(c.tokens) for c in chunks]).cumsum(0).tolist()
        slots = [(slots_of(c.blocks, c.stored, c.stored + len(c.tokens), self.block_size),
                  slots_of(c.blocks, 0, c.stored + len(c.tokens), self.block_size)) for c in chunks]
        # decode rows (a prompt's last token alone in its chunk reads as a prompt row: through attend)
        batched = [j for j, c in enumerate(chunks) if len(c.tokens) == 1 and c.observe_from is None and c.decode_from == 0]
        batched = batched if self.batch_decode else []
        if batched:
            width = max(len(chunks[j].blocks) for j in batched)
            tables = torch.tensor([chunks[j].blocks + [0] * (width - len(chunks[j].blocks)) for j in batched],
                                  dtype=torch.int32, device=self.device)
            lengths = torch.tensor([chunks[j].stored + 1 for j in batched], dtype=torch.int32, device=self.device)
            rows = torch.tensor([bounds[j] for j in batched], device=self.device)
        for i, layer in enumerate(s.layers):
            eps_in, eps_post = s.eps[i]
            q, k, v = attention_inputs(hidden, layer.input_layernorm.weight, eps_in, *s.qkv[i], cos, sin, s.heads)
            for c, (new, _), lo, hi in zip(chunks, slots, bounds, bounds[1:], strict=False):
                self.pool.write(i, new, k[lo:hi, :, 0], v[lo:hi, :, 0], owner=c.blocks[0], first=c.stored == 0)
            out = [None] * len(chunks)
            if batched:
                got = self.pool.decode(i, q[rows, :, 0], tables, lengths, s.scaling)
                for r, j in enumerate(batched):
                    out[j] = got[r:r + 1]
            for j, (c, (_, held), lo, hi) in enumerate(zip(chunks, slots, bounds, bounds[1:], strict=False)):
                if out[j] is not None:
                    continue
                qc = q[lo:hi, :, 0].transpose(0, 1)  # [Hq, n, D]
                out[j] = self.pool.attend(i, qc, held, s.scaling, c.decode_from).transpose(0, 1)
                if c.observe_from is not None:
                    c.queries.append(qc[:, c.observe_from:])
            attn = layer.self_attn
            hidden = layer_output(hidden, torch.cat(out), attn.o_proj.weight, attn.o_proj.bias,
                                  layer.post_attention_layernorm.weight, eps_post, *s.gate_up[i],
                                  layer.mlp.down_proj.weight, layer.mlp.down_proj.bias, s.act)
        last = hidden[torch.tensor(bounds[1:], device=self.device) - 1, -1]  # [len(chunks), H]
        return s.lm_head(rms_norm(s.norm, last))


def paged_decode_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                           lengths: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """What the Triton paged kernel computes, one request at a time: ``q [B, Hq, D]`` (one token
    each) over the slots its row of ``tables`` holds (``lengths`` of them) -> ``[B, Hq, D]``."""
    out = []
    for row, n in zip(tables.tolist(), lengths.tolist(), strict=True):
        slots = slots_of(row, 0, n, block_size).to(k_pool.device)
        out.append(attend(q[len(out)].unsqueeze(1), k_pool[slots].transpose(0, 1), v_pool[slots].transpose(0, 1),
                          scale)[:, 0])
    return torch.stack(out)

