"""Decode steps over block tables as CUDA graphs, one per batch-size bucket (nano-vllm's scheme): a step
whose chunks are all one decode token (a dense pool read by the Triton paged kernel) is padded to the
smallest bucket that holds it and replays that bucket's graph over static buffers: tokens, positions,
the new tokens' slots, block tables padded to the widest a request can hold, lengths. Padding rows
write into the pool's spare block (one past the allocator's) and read one slot of it. A batch over the
largest bucket, and any step on CPU, runs the same step eagerly (:meth:`DecodeGraphs.run`)."""

from __future__ import annotations

import torch

from kvlab.engine.llama import attention_inputs, layer_output, rms_norm, step_inputs

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # batch sizes captured (max_num_seqs' default is the last)


def bucket_for(batch: int, buckets: tuple[int, ...] = BUCKETS) -> int | None:
    """The smallest bucket holding ``batch`` decode rows (None: more rows than the largest bucket)."""
    if batch < 1:
        raise ValueError(f"a decode step has at least one row, got {batch}")
    return next((b for b in sorted(buckets) if b >= batch), None)


class DecodeGraphs:
    """``decode(tokens, positions, slots, tables, lengths) -> logits [B, V]`` of one decode token per
    request; captured per bucket on CUDA (on first use), eager elsewhere."""

    def __init__(self, step, pool, block_size: int, max_blocks: int, spare_block: int, kernel,
                 buckets: tuple[int, ...] = BUCKETS):
        self.step, self.pool, self.block_size, self.kernel = step, pool, block_size, kernel
        self.max_blocks, self.spare, self.buckets = max_blocks, spare_block, buckets
        self.device = pool.k.device
        self.graphs: dict[int, tuple] = {}  # bucket -> (graph, static inputs, static logits)

    def run(self, tokens, positions, slots, tables, lengths) -> torch.Tensor:
        """The step itself, tensors on the device in and out (what a graph captures)."""
        s = self.step
        hidden, cos, sin = step_inputs(s.embed, s.rotary, tokens[:, None], positions[:, None])
        for i, layer in enumerate(s.layers):
            eps_in, eps_post = s.eps[i]
            q, k, v = attention_inputs(hidden, layer.input_layernorm.weight, eps_in, *s.qkv[i], cos, sin, s.heads)
            self.pool.k[i].index_copy_(0, slots, k[:, :, 0].to(self.pool.dtype))
            self.pool.v[i].index_copy_(0, slots, v[:, :, 0].to(self.pool.dtype))
            out = self.kernel(q[:, :, 0], self.pool.k[i], self.pool.v[i], tables, lengths, self.block_size, s.scaling)
            attn = layer.self_attn
            hidden = layer_output(hidden, out, attn.o_proj.weight, attn.o_proj.bias, layer.post_attention_layernorm.weight,
                                  eps_post, *s.gate_up[i], layer.mlp.down_proj.weight, layer.mlp.down_proj.bias, s.act)
        return s.lm_head(rms_norm(s.norm, hidden[:, -1]))

    def inputs(self, batch: int, tokens, positions, slots, tables, lengths) -> dict[str, torch.Tensor]:
        """Host lists -> device tensors of ``batch`` rows, the rows past the real ones padding."""
        pad = batch - len(tokens)
        spare_slot = self.spare * self.block_size
        table = torch.full((batch, self.max_blocks), self.spare, dtype=torch.int32)
        for r, row in enumerate(tables):
            table[r, :len(row)] = torch.tensor(row, dtype=torch.int32)
        as_long = {"dtype": torch.long}
        return {"tokens": torch.tensor(list(tokens) + [0] * pad, **as_long).to(self.device),
                "positions": torch.tensor(list(positions) + [0] * pad, **as_long).to(self.device),
                "slots": torch.tensor(list(slots) + [spare_slot] * pad, **as_long).to(self.device),
                "tables": table.to(self.device),
                "lengths": torch.tensor(list(lengths) + [1] * pad, dtype=torch.int32).to(self.device)}

    @torch.no_grad()
    def decode(self, tokens, positions, slots, tables, lengths) -> torch.Tensor:
        n = len(tokens)
        bucket = bucket_for(n, self.buckets) if self.device.type == "cuda" else None
        if bucket is None:
            return self.run(**self.inputs(n, tokens, positions, slots, tables, lengths))
        if bucket not in self.graphs:
            self.graphs[bucket] = self.capture(bucket)
        graph, static, logits = self.graphs[bucket]
        for name, value in self.inputs(bucket, tokens, positions, slots, tables, lengths).items():
            static[name].copy_(value)
        graph.replay()
        return logits[:n]

    def capture_upto(self, max_batch: int) -> None:
        """Capture every bucket a step of up to ``max_batch`` rows replays (CUDA only), so that no
        measured step pays for a capture."""
        if self.device.type != "cuda":
            return
        top = bucket_for(max_batch, self.buckets) or max(self.buckets)
        for bucket in sorted(self.buckets):
            if bucket <= top and bucket not in self.graphs:
                self.graphs[bucket] = self.capture(bucket)

    def capture(self, bucket: int) -> tuple:
        static = self.inputs(bucket, [], [], [], [], [])  # every row padding: the spare block
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up (Triton's compile, allocator pools) off the capture
            self.run(**static)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self.run(**static)
        return graph, static, logits
