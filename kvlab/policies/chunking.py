"""What each cache does when a prompt arrives in chunks (``prefill_chunk``), and the switch for it.

Why: a one-shot prefill builds every layer's full K/V (and n-token activations) before an evicting
cache compresses, so a 10% cache still costs the full cache at its peak. Streamed in chunks, a cache
never holds much more than its budget plus one chunk.

Semantics, per kind of cache (``n`` = the whole prompt's length, known when the stream begins):

- **full** (``DynamicCache``): chunks are appended; the same cache as one shot, smaller transients.
- **evictions** (streamingllm, snapkv, pyramidkv, tova, knorm, random; kvlab's *running budget*):
  each layer keeps at most its one-shot budget ``budget(n)`` rows (``floor(n x keep)``, or
  PyramidKV's per-layer share of ``n``). A chunk is appended to the kept rows; when they exceed the
  budget, the method scores kept rows + chunk together and keeps the top ``budget(n)``, the
  scores coming from the *latest* chunk: SnapKV/PyramidKV use the chunk's last ``window_size``
  queries (fewer if the chunk is shorter) over kept rows + chunk, TOVA the chunk's last query;
  SnapKV's pooling runs over the rows in cache order (kept rows are not contiguous positions);
  knorm keeps the lowest norms among the keys it saw, streamingllm sinks + the most recent (the
  same positions as one shot); random redraws per chunk. A chunk attends to the rows kept from
  earlier chunks, not to the whole prefix: that is what saves the memory, and why deeper layers'
  keys (and so their scores) differ from one shot's. The last chunk's eviction leaves exactly
  ``budget(n)`` rows per layer, as one shot does (the fast engine's buffers fit either way), and a
  chunk of at least ``n`` tokens reproduces the one-shot selection exactly. Rows stay unquantized
  until the prompt ends (evict-then-quantize stores them then), so chunks attend to exact K/V.
  ``kept_positions(cache)`` still gives the original prompt positions of every kept row.
- **quantized caches** quantize each chunk as it lands (their stock ``update``): kvq appends the
  chunk's codes; quanto/HQQ re-quantize the whole layer (dequantized past + chunk) whenever the
  residual fills, i.e. at every chunk of >= ``residual_length`` tokens; transformers' fp8 freezes
  its per-tensor scale on the first chunk and saturates later ones. Chunks after the first attend
  to the dequantized past, as decode steps do.
- **decoding** (:mod:`kvlab.policies.decoding`): the prompt is kept whole; chunks are appended.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def streaming(cache, prompt_length: int) -> Iterator[None]:
    """Tell a fresh cache's evicting layers that the next ``prompt_length`` tokens are one prompt
    arriving in chunks; on exit they store what they kept. Caches without such layers are untouched."""
    layers = [layer for layer in cache.layers if hasattr(layer, "begin_stream")]
    for layer in layers:
        layer.begin_stream(prompt_length)
    try:
        yield
    finally:
        errors = []
        for layer in layers:
            try:
                layer.end_stream()
            except Exception as err:  # noqa: BLE001 - end every layer, then raise the first
                errors.append(err)
        if errors:
            raise errors[0]
