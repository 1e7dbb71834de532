"""Static KV buffers for the fast engine: sized once, written in place, attended by length.

Each layer ``l`` owns buffers of ``capacity_l = kept_l + new_tokens`` slots. The prefill's kept K/V
fill slots ``[0, kept_l)`` (``load``: every batch row at once, or a slice of rows per call when the
batch is prefilled in row groups); decode step ``s`` writes its token at slot ``kept_l + s`` and
attends over the first ``kept_l + s + 1`` slots. ``step`` is a device tensor advanced inside the step, so a
captured CUDA graph replays every step unchanged: nothing on the host changes between tokens.

:class:`DenseStore` keeps K/V at the model dtype in ``[B, Hkv, C, D]``, head-major: each (row, KV head)
is one contiguous segment of ``C`` slots, which flash attention's variable-length kernel reads as a
sequence of its own (one KV head, the GQA group's query heads; ``seqused_k`` per segment). Attention
is either that kernel (``flash``, CUDA) or SDPA with a length mask (``sdpa``, any device, the CPU
reference). Why segments: handed ``[B, C, Hkv, D]`` with ``B > 1``, the kernel's own GQA transpose
of the queries is not a view, and torch copies q before it and the output (twice) after it: three
copy kernels per layer, 96 per step and 0.25 ms of 13.2 at batch 16 on the H200
(reports/h200-2026-12-03f/minimal_step.json); with one KV head per sequence they are views.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvlab.kernels import decode_attention, make_workspace, parse_format, quantize_write
from kvlab.kernels.key_offset import OffsetKeysFormat, split_format

ATTENTION = ("auto", "flash", "sdpa")
DENSE_ATTENTION = (*ATTENTION, "cudnn")  # the dense store's: cuDNN's attention over a length bias too


@dataclass(frozen=True)
class Layout:
    """What fixes a store's buffers (and so a captured graph): batch, per-layer kept tokens, room."""

    batch: int
    kept: tuple[int, ...]
    new_tokens: int
    kv_heads: int
    head_dim: int

    @property
    def capacity(self) -> tuple[int, ...]:
        return tuple(k + self.new_tokens for k in self.kept)

    def dense_bytes(self, element_size: int) -> int:
        """Bytes of K and V at full capacity stored densely (an upper bound for quantized formats)."""
        return 2 * sum(self.capacity) * self.batch * self.kv_heads * self.head_dim * element_size


def flash_available(device, dtype) -> bool:
    return torch.device(device).type == "cuda" and dtype in (torch.bfloat16, torch.float16)


def dense_attention(attention: str, device, dtype, kernels: tuple[str, ...] = ATTENTION) -> str:
    """A model-dtype store's kernel: ``attention`` checked against ``kernels``, ``auto`` resolved
    (flash where it runs)."""
    if attention not in kernels:
        raise ValueError(f"attention={attention!r}: use one of {', '.join(kernels)}")
    if attention == "auto":
        return "flash" if flash_available(device, dtype) else "sdpa"
    if attention in ("flash", "cudnn") and not flash_available(device, dtype):
        raise ValueError(f"attention={attention!r} needs a CUDA device and bf16/fp16: use 'sdpa'")
    return attention


def sdpa_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, length: torch.Tensor,
                scale: float) -> torch.Tensor:
    """Attention of one query per sequence over the first ``length`` slots; ``[B, Hq, D]``.

    ``q`` ``[B, Hq, 1, D]``; ``keys``/``values`` ``[B, Hkv, C, D]``; ``length`` a device tensor ``[1]``.
    The GQA group's queries become the query rows of their KV head, so K/V are never repeated.
    """
    bsz, n_heads, _, dim = q.shape
    n_kv, cap = keys.shape[1], keys.shape[2]
    groups = n_heads // n_kv
    valid = torch.arange(cap, device=keys.device) < length  # [C]
    out = F.scaled_dot_product_attention(
        q.reshape(bsz, n_kv, groups, dim), keys, values, attn_mask=valid.view(1, 1, 1, cap), scale=scale)
    return out.reshape(bsz, n_heads, dim)


def cudnn_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """cuDNN's attention over a head-major store, lengths as an additive ``bias`` ``[1, 1, 1, C]``
    (0 over the used slots, -inf past them); ``[B, Hq, D]``.

    Why beside flash: the minimal step's cuDNN kernel (``enable_gqa``, the same K/V bytes) read 16k
    slots in 0.74 ms per step at batch 1 where flash's split-KV kernel and its combine pass took 0.99
    (reports/h200-2026-12-03f). One bias serves every row (all rows hold the same length), and the
    shapes are fixed, so cuDNN builds one plan per layout, not one per length. SDPA is pinned to
    cuDNN (:func:`cudnn_pin`): a call it cannot take fails instead of falling back."""
    bsz, n_heads, _, dim = q.shape
    with cudnn_pin():
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=scale, enable_gqa=True)
    return out.reshape(bsz, n_heads, dim)


def cudnn_pin():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.CUDNN_ATTENTION])


def flash_varlen(q, keys, values, cu_q, cu_k, max_k: int, used, scale: float,
                 splits: int | None = None) -> torch.Tensor:
    """flash attention's varlen forward, one query position per sequence: ``q`` ``[S, G, D]``,
    ``keys``/``values`` ``[N, 1, D]`` (one KV head); sequence ``i`` attends rows ``cu_k[i] .. cu_k[i] +
    used[i]``; ``[S, G, D]``. With one KV head the kernel's GQA transpose of ``q`` and of its output
    are views at any batch (no copy kernels). ``splits``: the split-KV count (None: flash's own
    heuristic; only where torch's op takes ``num_splits``, :func:`flash_takes_splits`)."""
    extra = {} if splits is None else {"num_splits": splits}
    return torch.ops.aten._flash_attention_forward(q, keys, values, cu_q, cu_k, 1, max_k, 0.0, False, False,
                                                   scale=scale, seqused_k=used, **extra)[0]


def flash_takes_splits() -> bool:
    """Whether this torch's ``_flash_attention_forward`` takes ``num_splits`` (torch 2.13 does)."""
    schema = torch.ops.aten._flash_attention_forward.default._schema
    return any(arg.name == "num_splits" for arg in schema.arguments)


def flash_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, used: torch.Tensor,
                 scale: float, cu_q: torch.Tensor | None = None, cu_k: torch.Tensor | None = None,
                 splits: int | None = None) -> torch.Tensor:
    """flash attention's varlen kernel over a head-major store; ``[B, Hq, D]``.

    ``q`` ``[B, Hq, 1, D]``; ``keys``/``values`` ``[B, Hkv, C, D]``: each (row, KV head) is a sequence
    (:func:`flash_varlen`) with its GQA group's ``Hq / Hkv`` query heads. ``used`` is int32 ``[B Hkv]``
    (each segment's used slots, :func:`segment_lengths`) on the device, so the same launch serves
    every step (graph-safe). ``cu_q``/``cu_k`` (:func:`cumulative_offsets` of the ``B Hkv`` segments,
    constants of the shape) may be passed in precomputed, so that a step launches no kernel to build them.
    """
    bsz, n_heads, _, dim = q.shape
    n_kv, cap = keys.shape[1], keys.shape[2]
    segments = bsz * n_kv
    if cu_q is None:
        cu_q, cu_k = cumulative_offsets(segments, cap, q.device)
    out = flash_varlen(q.reshape(segments, n_heads // n_kv, dim), keys.view(-1, 1, dim), values.view(-1, 1, dim),
                       cu_q, cu_k, cap, used, scale, splits)
    return out.view(bsz, n_heads, dim)


def cumulative_offsets(sequences: int, capacity: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """flash varlen's ``cu_seqlens`` for one query position per sequence and ``capacity`` slots each
    (a head-major store's sequences are its ``B Hkv`` segments)."""
    cu_q = torch.arange(sequences + 1, device=device, dtype=torch.int32)
    return cu_q, cu_q * capacity


def segment_lengths(used: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Per-row used lengths ``[B]`` as :func:`flash_decode`'s per-segment ``[B Hkv]`` (int32; outside
    a step, e.g. a benchmark: the store's :class:`StepSlots` fill theirs in the same kernel)."""
    return used.to(torch.int32).repeat_interleave(kv_heads).contiguous()


def row_slice(rows: slice | None, batch: int, got: int, layer: int) -> slice:
    """``rows`` (None: all ``batch`` rows) as a plain ``start:stop`` slice holding ``got`` rows."""
    if rows is None:
        rows = slice(None)
    if not isinstance(rows, slice) or rows.step not in (None, 1):
        raise ValueError(f"rows must be a contiguous slice of batch rows such as slice(0, 4), got {rows!r}")
    start, stop, _ = rows.indices(batch)
    if stop - start != got:
        raise ValueError(f"layer {layer} holds {got} sequences, rows {start}:{stop} of the store's batch of "
                         f"{batch} are {max(0, stop - start)}")
    return slice(start, stop)


class StepSlots:
    """Where each layer writes this step's token and how many slots it then attends over.

    Computed once per step for every layer (:meth:`begin`: three small kernels) instead of once per
    layer, since a graph-captured step is bound by the number of kernels it launches as much as by
    bytes. ``slot(l)`` is a ``[1]`` view (``index_copy_``'s index), ``used(l)`` an int32 ``[B]``
    view (the attention kernels' lengths). With ``segments`` (a head-major store's KV heads),
    ``segment_used(l)`` is the same length per (row, KV head), ``[B segments]``, for
    :func:`flash_decode`: both are slices of one buffer, filled by the same kernel.
    """

    def __init__(self, kept: tuple[int, ...], batch: int, device, segments: int = 0):
        self.step = torch.zeros(1, dtype=torch.long, device=device)
        self._base = torch.tensor(kept, dtype=torch.long, device=device)
        self._slots = self._base.clone()
        self._batch = batch
        self._used = torch.zeros(len(kept), batch * (1 + segments), dtype=torch.int32, device=device)

    def begin(self) -> None:
        torch.add(self._base, self.step, out=self._slots)
        self._used.copy_((self._slots + 1).unsqueeze(1).expand_as(self._used))

    def slot(self, layer: int) -> torch.Tensor:
        return self._slots[layer:layer + 1]

    def used(self, layer: int) -> torch.Tensor:
        return self._used[layer, :self._batch]

    def used_column(self) -> torch.Tensor:
        """Every layer's used slots as an int32 ``[L, 1]`` view (the same for every row)."""
        return self._used[:, :1]

    def segment_used(self, layer: int) -> torch.Tensor:
        return self._used[layer, self._batch:]

    def advance(self) -> None:
        self.step.add_(1)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.step, self._slots, self._used


class SlotStore:
    """What every store shares: each layer's slots per step (:class:`StepSlots`), the prefill load
    loop (a store writes one layer's rows in ``_load_layer``) and ``attend`` (``_attend``) inside
    ``profile_scope``: a profiler scope name around every ``attend`` (None: none), the hook
    :mod:`kvlab.engine.anatomy` sets on eager steps so that attention's ops are named as such."""

    profile_scope: str | None = None
    rewinds = True  # slots past a step are rewritten before they are read: a decoder can go back to it
    layout: Layout
    slots: StepSlots

    @property
    def step(self) -> torch.Tensor:
        return self.slots.step

    def load(self, layer_kv, rows: slice | None = None) -> None:
        """Store each layer's kept prefill K/V (``[b, Hkv, n_l, D]`` pairs) in its first slots, of
        batch rows ``rows`` (None: all, ``b = B``)."""
        for i, (k, v) in enumerate(layer_kv):
            n = k.shape[-2]
            if n != self.layout.kept[i]:
                raise ValueError(f"layer {i} kept {n} tokens, the store was sized for {self.layout.kept[i]}")
            self._load_layer(i, row_slice(rows, self.layout.batch, k.shape[0], i), k, v)
        self.step.zero_()

    def begin(self) -> None:
        """Once per step, before the first layer: every layer's slot and length."""
        self.slots.begin()

    def attend(self, layer: int, q, k, v) -> torch.Tensor:
        if self.profile_scope is None:
            return self._attend(layer, q, k, v)
        from torch.profiler import record_function

        with record_function(self.profile_scope):
            return self._attend(layer, q, k, v)

    def advance(self) -> None:
        self.slots.advance()

    def held_bytes(self, held: list[int]) -> int:
        """Bytes holding ``held[l]`` tokens in each layer ``l``, every sequence (what ``stats`` reports)."""
        return sum(held) * self.layout.batch * self.bytes_per_slot()

    def _load_layer(self, layer: int, rows: slice, k: torch.Tensor, v: torch.Tensor) -> None:
        raise NotImplementedError

    def _attend(self, layer: int, q, k, v) -> torch.Tensor:
        raise NotImplementedError


class ModelDtypeStore(SlotStore):
    """A store whose ``keys``/``values`` are one model-dtype tensor per layer (:class:`DenseStore`,
    :class:`~kvlab.engine.kvstore_ragged.RaggedStore`): their bytes and the buffers a step touches."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    def bytes_allocated(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor a step writes or reads in place (for compilers that must know them as static)."""
        return [*self.keys, *self.values, *self.slots.tensors()]

    def bytes_per_slot(self) -> int:
        """Bytes one token position takes in one layer (K and V, all KV heads, one sequence)."""
        return 2 * self.layout.kv_heads * self.layout.head_dim * self.keys[0].element_size()


class DenseStore(ModelDtypeStore):
    """Per-layer K/V at the model dtype, ``[B, Hkv, C_l, D]``, attended with ``flash``, ``sdpa`` or
    ``cudnn`` (:func:`cudnn_decode`, opt-in: ``auto`` stays flash until it is measured faster).

    ``offsets[l]``: flash's ``cu_seqlens`` for layer ``l``'s ``B Hkv`` segments (constants).
    ``splits``: flash's split-KV count (None: its heuristic; :func:`flash_varlen`). ``bias[l]``:
    cuDNN's length bias for layer ``l``, computed for every layer in :meth:`begin` (two kernels)."""

    kv_format = "model dtype"

    def __init__(self, layout: Layout, dtype, device, scale: float, attention: str = "auto",
                 splits: int | None = None):
        self.layout = layout
        self.attention = dense_attention(attention, device, dtype, DENSE_ATTENTION)
        self.scale = scale
        self.splits = splits
        b, h, d = layout.batch, layout.kv_heads, layout.head_dim
        self.keys = [torch.zeros(b, h, c, d, dtype=dtype, device=device) for c in layout.capacity]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.slots = StepSlots(layout.kept, layout.batch, device, segments=h)
        self.offsets = [cumulative_offsets(b * h, c, device) for c in layout.capacity]
        width = -(-max(layout.capacity) // 8) * 8  # rows 16-byte aligned, as cuDNN wants its operands
        self._slot_index = torch.arange(width, dtype=torch.int32, device=device)
        self._bias = torch.zeros(len(layout.kept), width, dtype=dtype, device=device)
        self._open, self._shut = (torch.tensor(x, dtype=dtype, device=device) for x in (0.0, float("-inf")))

    def begin(self) -> None:
        """Every layer's slot and length, and with ``cudnn`` its length bias."""
        super().begin()
        if self.attention == "cudnn":
            torch.where(self._slot_index < self.slots.used_column(), self._open, self._shut, out=self._bias)

    def bias(self, layer: int) -> torch.Tensor:
        return self._bias[layer, :self.layout.capacity[layer]].view(1, 1, 1, -1)

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor a step writes or reads in place, the cuDNN length bias included."""
        return [*super().buffers(), self._bias]

    def _load_layer(self, layer: int, rows: slice, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[-2]
        self.keys[layer][rows, :, :n].copy_(k)
        self.values[layer][rows, :, :n].copy_(v)

    def _attend(self, layer: int, q, k, v) -> torch.Tensor:
        slot = self.slots.slot(layer)
        self.keys[layer].index_copy_(2, slot, k)
        self.values[layer].index_copy_(2, slot, v)
        if self.attention == "flash":
            return flash_decode(q, self.keys[layer], self.values[layer], self.slots.segment_used(layer), self.scale,
                                *self.offsets[layer], splits=self.splits)
        if self.attention == "cudnn":
            return cudnn_decode(q, self.keys[layer], self.values[layer], self.bias(layer), self.scale)
        return sdpa_decode(q, self.keys[layer], self.values[layer], slot + 1, self.scale)


QUANT_ATTENTION = ("auto", "fused", "dequantize")


class QuantizedStore(SlotStore):
    """Per-layer K/V in a :mod:`kvlab.kernels` format (``[B, Hkv, C_l, ...]`` codes and scales).

    The new token is quantized on write (one Triton launch per tensor on CUDA), before it attends,
    as ``hf``'s :class:`~kvlab.policies.quantized.kvq_layers.KVQLayer` does. Attention is ``fused``
    (the split-K Triton kernel reads the codes: float16 operands, float32 accumulation and softmax;
    the float32 reference on CPU) or ``dequantize``: the whole store converted to the model dtype,
    then masked SDPA, i.e. what an implementation without a fused kernel does (``hf``'s arithmetic),
    kept as the explicit baseline.

    With an :class:`~kvlab.kernels.key_offset.OffsetKeysFormat` the keys are written minus a per-layer
    ``[B, Hkv, D]`` float32 offset (``key_offsets``), fitted on each row's prompt keys when they are
    loaded and subtracted inside the write kernel for every later token; attention reads the codes
    as they are (the offset shifts every score of a query by the same amount).
    """

    def __init__(self, layout: Layout, kv_format: str | OffsetKeysFormat, num_heads: int, dtype, device,
                 scale: float, attention: str = "auto"):
        if attention not in QUANT_ATTENTION:
            raise ValueError(f"attention={attention!r} for a quantized store: use one of {', '.join(QUANT_ATTENTION)}")
        name, self.offset_rule = split_format(kv_format)
        self.fmt = parse_format(name)
        self.kv_format = kv_format.label if isinstance(kv_format, OffsetKeysFormat) else self.fmt.label
        self.attention = "fused" if attention == "auto" else attention
        self.layout, self.scale, self.dtype = layout, scale, dtype
        b, h, d = layout.batch, layout.kv_heads, layout.head_dim
        self.keys = [self.fmt.alloc(b, h, c, d, device) for c in layout.capacity]
        self.values = [self.fmt.alloc(b, h, c, d, device) for c in layout.capacity]
        self.key_offsets = [torch.zeros(b, h, d, dtype=torch.float32, device=device)
                            if self.offset_rule.subtracts else None for _ in layout.capacity]
        cuda = torch.device(device).type == "cuda"
        self.workspaces = [make_workspace(num_heads, k) if cuda else None for k in self.keys]
        self.slots = StepSlots(layout.kept, layout.batch, device)

    def bytes_allocated(self) -> int:
        offsets = sum(t.numel() * t.element_size() for t in self.key_offsets if t is not None)
        return sum(s.nbytes() for s in self.keys + self.values) + offsets

    def buffers(self) -> list[torch.Tensor]:
        offsets = [t for t in self.key_offsets if t is not None]
        return [t for s in self.keys + self.values for t in s.tensors()] + offsets + list(self.slots.tensors())

    def bytes_per_slot(self) -> int:
        return 2 * self.fmt.bytes_per_token(self.layout.kv_heads, self.layout.head_dim)

    def held_bytes(self, held: list[int]) -> int:
        """The slots' bytes plus the key offsets' (``head_dim`` float32 per row, KV head and layer)."""
        offsets = sum(t.numel() * t.element_size() for t in self.key_offsets if t is not None)
        return super().held_bytes(held) + offsets

    def key_offset(self, layer: int, rows: slice = slice(None)) -> torch.Tensor | None:
        """Layer ``layer``'s key offset of batch rows ``rows`` (a view), None without one."""
        offset = self.key_offsets[layer]
        return None if offset is None else offset[rows]

    def fit_key_offset(self, layer: int, rows: slice, keys: torch.Tensor) -> torch.Tensor | None:
        """Fit rows ``rows``' key offset of layer ``layer`` on their prompt ``keys`` (``[b, Hkv, n, D]``)."""
        offset = self.key_offset(layer, rows)
        if offset is not None:
            offset.copy_(self.offset_rule.fit(keys))
        return offset

    def _load_layer(self, layer: int, rows: slice, k: torch.Tensor, v: torch.Tensor) -> None:
        slots = torch.arange(k.shape[-2], device=k.device)
        offset = self.fit_key_offset(layer, rows, k)
        quantize_write(self.keys[layer].rows(rows), k.contiguous(), slots, offset=offset)
        quantize_write(self.values[layer].rows(rows), v.contiguous(), slots)

    def _attend(self, layer: int, q, k, v) -> torch.Tensor:
        slot = self.slots.slot(layer)
        quantize_write(self.keys[layer], k, slot, offset=self.key_offsets[layer])
        quantize_write(self.values[layer], v, slot)
        bsz, n_heads, _, dim = q.shape
        if self.attention == "fused":
            out = decode_attention(q.reshape(bsz, n_heads, dim).contiguous(), self.keys[layer], self.values[layer],
                                   self.slots.used(layer), self.scale, workspace=self.workspaces[layer])
            return out.to(q.dtype)
        keys = self.keys[layer].dequantize().to(self.dtype)
        values = self.values[layer].dequantize().to(self.dtype)
        return sdpa_decode(q, keys, values, slot + 1, self.scale)
