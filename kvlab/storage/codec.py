"""Storage families whose K/V are per-vector codes with a torch reference codec (NVFP4, rotated
codebooks, rotated kvq formats): both halves written once, over a pair of codecs and an optional
orthogonal rotation per KV head.

A codec turns ``[B, Hkv, n, D]`` vectors into a tuple of tensors ``[B, Hkv, n, ...]`` (``encode``)
and back to float32 (``decode``), and says its bytes per vector (``token_bytes(D)``). Codes are
computed per vector, so appending is concatenating along the token dim and the fast store writes a
token's codes into its slot.

With a rotation ``R`` (``[Hkv, D, D]``, orthogonal) K and V are rotated on append and stored in the
rotated basis. The ``fast`` store attends there: the query is rotated once per step, the softmax
weights the rotated values, and that sum is rotated back once
(:func:`kvlab.kernels.turboquant.rotated_decode`, or the storage's fused kernel). The ``hf`` layer hands transformers the decoded
K/V rotated back (dequantize, then attend): equal scores and outputs up to float rounding, since
``q R . k R = q . k``.

Semantics, as kvq's: the prompt attends exactly and is then stored; every later token is stored before
it attends, itself included; nothing is kept unquantized.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvlab.kernels.turboquant import rotate, rotated_decode, unrotate
from kvlab.storage.base import ModelShape, StoredLengthMixin, StoreOptions, tensor_bytes
from kvlab.storage.loading import PromptStorage
from kvlab.storage.slots import Layout, SlotStore, StepSlots, sdpa_decode


class CodecLayer(StoredLengthMixin, DynamicLayer):
    """hf half: K and V as codec tensors (``key_parts``/``value_parts``), decoded for attention."""

    is_croppable = True

    def __init__(self, storage):
        super().__init__()
        self.storage = storage
        self.key_parts: tuple[torch.Tensor, ...] | None = None
        self.value_parts: tuple[torch.Tensor, ...] | None = None
        self.rot: torch.Tensor | None = None
        self.dtype: torch.dtype | None = None

    @property
    def stored_tokens(self) -> int:
        return 0 if self.key_parts is None else self.key_parts[0].shape[2]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        first = not self.is_initialized
        if first:
            self.lazy_initialization(key_states, value_states)
            self.dtype = key_states.dtype
            self.rot = self.storage.rotation(key_states.shape[1], key_states.shape[-1], key_states.device)
        kcodec, vcodec = self.storage.codecs()
        new_k = kcodec.encode(in_basis(key_states, self.rot))
        new_v = vcodec.encode(in_basis(value_states, self.rot))
        if first:
            self.key_parts, self.value_parts = new_k, new_v
            return key_states, value_states  # the prefill attends exactly
        self.key_parts = tuple(torch.cat([a, b], 2) for a, b in zip(self.key_parts, new_k, strict=True))
        self.value_parts = tuple(torch.cat([a, b], 2) for a, b in zip(self.value_parts, new_v, strict=True))
        keys = out_of_basis(kcodec.decode(*self.key_parts), self.rot)
        values = out_of_basis(vcodec.decode(*self.value_parts), self.rot)
        return keys.to(self.dtype), values.to(self.dtype)

    def _map(self, fn) -> None:
        if self.key_parts is not None:
            self.key_parts = tuple(fn(t) for t in self.key_parts)
            self.value_parts = tuple(fn(t) for t in self.value_parts)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        keep = max(0, self.stored_tokens + tokens_to_remove)
        self._map(lambda t: t[:, :, :keep])

    def reset(self) -> None:
        super().reset()
        self.key_parts = self.value_parts = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def nbytes(self) -> int:
        return tensor_bytes((self.key_parts, self.value_parts))


def in_basis(x: torch.Tensor, rot: torch.Tensor | None) -> torch.Tensor:
    return x.float() if rot is None else rotate(x, rot)


def out_of_basis(y: torch.Tensor, rot: torch.Tensor | None) -> torch.Tensor:
    return y if rot is None else unrotate(y, rot)


class CodecStore(SlotStore):
    """fast half: per layer the codec tensors of K and V at capacity ``[B, Hkv, C, ...]``; the storage's
    fused kernel where it has one for this device and backend (``attention`` 'fused'), else decode then
    attend ('reference': SDPA at the model dtype; the rotated basis in float32 with a rotation)."""

    rewinds = True

    def __init__(self, storage, layout: Layout, dtype, device, scale: float, backend: str = "auto"):
        self.storage, self.layout, self.dtype, self.scale = storage, layout, dtype, scale
        self.fused = storage.fused_decode(backend, device)
        self.attention = "reference" if self.fused is None else "fused"
        self.kv_format = storage.kv_format
        b, h, d = layout.batch, layout.kv_heads, layout.head_dim
        self.rot = storage.rotation(h, d, device)
        kcodec, vcodec = storage.codecs()
        self.keys = [kcodec.encode(torch.zeros(b, h, c, d, device=device)) for c in layout.capacity]
        self.values = [vcodec.encode(torch.zeros(b, h, c, d, device=device)) for c in layout.capacity]
        self.slots = StepSlots(layout.kept, b, device)

    def buffers(self) -> list[torch.Tensor]:
        return [t for parts in self.keys + self.values for t in parts] + list(self.slots.tensors())

    def bytes_allocated(self) -> int:
        return tensor_bytes((self.keys, self.values))

    def bytes_per_slot(self) -> int:
        return self.storage.token_bytes(self.layout.kv_heads, self.layout.head_dim)

    def _load_layer(self, layer: int, rows: slice, k: torch.Tensor, v: torch.Tensor) -> None:
        kcodec, vcodec = self.storage.codecs()
        n = k.shape[-2]
        for dst, src in ((self.keys[layer], kcodec.encode(in_basis(k, self.rot))),
                         (self.values[layer], vcodec.encode(in_basis(v, self.rot)))):
            for buf, part in zip(dst, src, strict=True):
                buf[rows, :, :n] = part

    def _attend(self, layer: int, q, k, v) -> torch.Tensor:
        slot = self.slots.slot(layer)
        kcodec, vcodec = self.storage.codecs()
        for dst, src in ((self.keys[layer], kcodec.encode(in_basis(k, self.rot))),
                         (self.values[layer], vcodec.encode(in_basis(v, self.rot)))):
            for buf, part in zip(dst, src, strict=True):
                put_slot(buf, slot, part)
        if self.fused is not None:
            return self.fused(q, self.keys[layer], self.values[layer], slot + 1, self.rot, self.scale).to(q.dtype)
        keys, values = kcodec.decode(*self.keys[layer]), vcodec.decode(*self.values[layer])
        if self.rot is None:
            return sdpa_decode(q, keys.to(self.dtype), values.to(self.dtype), slot + 1, self.scale)
        return rotated_decode(q, keys, values, slot + 1, self.rot, self.scale).to(q.dtype)


def put_slot(buf: torch.Tensor, slot: torch.Tensor, part: torch.Tensor) -> None:
    """``buf[:, :, slot] = part`` (float8 codes written through a byte view: CPU has no float8 index_copy)."""
    if buf.dtype.is_floating_point and buf.element_size() == 1:
        buf, part = buf.view(torch.uint8), part.view(torch.uint8)
    buf.index_copy_(2, slot, part)


class CodecStorage(PromptStorage):
    """The storage protocol for a family of codecs; a subclass (a frozen dataclass of its parameters)
    gives ``codecs() -> (key codec, value codec)``, ``rotation(kv_heads, D, device)`` (None: none),
    ``kv_format`` and its own ``check`` (paged layout, prefill cache, load and kept: PromptStorage's)."""

    attends_own_queries = False
    keys_per_token = True  # each key vector coded alone (rotated or not): a bias-driven channel sets its range

    def codecs(self):
        raise NotImplementedError

    def rotation(self, kv_heads: int, head_dim: int, device) -> torch.Tensor | None:
        return None

    def fused_decode(self, backend: str, device):
        """A fused decode ``(q, key_parts, value_parts, used, rot, scale) -> [B, Hq, D]`` for the fast
        store, or None: the torch reference (``backend``: StoreOptions.backend)."""
        return None

    def check(self, shape: ModelShape, cuda: bool) -> None:
        shape.check_full_attention(f"{self.name} stores")

    def make_cache(self, num_layers: int):
        return Cache(layers=[CodecLayer(self) for _ in range(num_layers)])

    def token_bytes(self, kv_heads: int, head_dim: int, element_size: int = 2) -> float:
        kcodec, vcodec = self.codecs()
        return kv_heads * (kcodec.token_bytes(head_dim) + vcodec.token_bytes(head_dim))

    def store(self, layout: Layout, options: StoreOptions):
        return CodecStore(self, layout, options.dtype, options.device, options.scale, options.backend)
