"""The fast engine's stores for issue 29's reads, beside :mod:`kvlab.engine.kvstore`'s dense and
quantized ones (same :class:`~kvlab.engine.kvstore.SlotStore` contract: slots per step, ``load``,
``attend``, every write on the device so a captured graph replays unchanged).

:class:`KiviSlotStore` holds each layer in a KIVI-style store (:mod:`kvlab.kernels.kivi`): the new
token goes into the bf16 ring and a group is quantized when it fills (``kivi_append``), attention is
the fused split-K kernel on CUDA and the torch reference elsewhere (``kivi_decode_attention``).

:class:`QuestStore` is a :class:`~kvlab.engine.kvstore.DenseStore` plus page bounds
(:mod:`kvlab.kernels.quest`): layers below ``dense_layers`` attend densely; the others select pages
from the query (inside the profiler scope ``kvlab::quest_select``, so the anatomy shows the
selection's own cost on eager steps; on CUDA the bounds' append is one kernel and the selection two,
:mod:`kvlab.kernels.quest_bounds` and :mod:`kvlab.kernels.quest_select`) and read only those
(``quest_decode_attention``).

:func:`read_store` picks one from what a policy's ``fast_storage()`` returned.
"""

from __future__ import annotations

import math

import torch
from torch.profiler import record_function

from kvlab.anatomy import SCOPE_SELECT
from kvlab.engine.kvstore import DenseStore, Layout, SlotStore, StepSlots
from kvlab.kernels import kivi, quest
from kvlab.kernels.kivi_decode import kivi_append, kivi_decode_attention, make_kivi_workspace
from kvlab.kernels.quest_decode import make_quest_workspace, quest_decode_attention


class KiviSlotStore(SlotStore):
    """Per-layer :class:`kvlab.kernels.kivi.KiviStore` s sized for ``capacity_l`` tokens."""

    rewinds = False  # the ring and the flushed groups follow every token written

    attention = "kivi"

    def __init__(self, layout: Layout, spec: kivi.KiviSpec, num_heads: int, device, scale: float,
                 backend: str = "auto"):
        self.layout, self.spec, self.scale, self.backend = layout, spec, scale, backend
        self.kv_format = spec.label
        b, h, d = layout.batch, layout.kv_heads, layout.head_dim
        self.stores = [kivi.alloc(spec, b, h, c, d, device) for c in layout.capacity]
        kernel = uses_kernel(backend, device)
        self.workspaces = [make_kivi_workspace(num_heads, s) if kernel else None for s in self.stores]
        self.slots = StepSlots(layout.kept, layout.batch, device)

    def bytes_allocated(self) -> int:
        return sum(s.nbytes() for s in self.stores)

    def buffers(self) -> list[torch.Tensor]:
        return [t for s in self.stores for t in s.tensors()] + list(self.slots.tensors())

    def bytes_per_slot(self) -> int:
        """Bytes of one quantized token in one layer (K and V, all KV heads, scales included, rounded
        up; the ring's fixed bf16 window is in :meth:`bytes_allocated`)."""
        return math.ceil(self.layout.kv_heads * self.spec.token_bytes(self.layout.head_dim))

    def held_bytes(self, held: list[int]) -> int:
        """Codes and scales of the quantized tokens, bf16 for those still in the ring (as ``cache_stats``
        counts a :class:`~kvlab.policies.kivi_layer.KiviLayer`)."""
        h, d, b = self.layout.kv_heads, self.layout.head_dim, self.layout.batch
        exact = 2 * h * d * kivi.RESIDUAL_DTYPE.itemsize
        return b * sum(math.ceil(self.spec.quantized_tokens(n) * h * self.spec.token_bytes(d))
                       + (n - self.spec.quantized_tokens(n)) * exact for n in held)

    def _load_layer(self, layer: int, rows: slice, k: torch.Tensor, v: torch.Tensor) -> None:
        kivi.load(self.stores[layer].rows(rows), k, v)

    def _attend(self, layer: int, q, k, v) -> torch.Tensor:
        store = self.stores[layer]
        kivi_append(store, k, v, self.slots.slot(layer), backend=self.backend)
        bsz, n_heads, _, dim = q.shape
        out = kivi_decode_attention(q.reshape(bsz, n_heads, dim).contiguous(), store, self.slots.used(layer),
                                    self.scale, workspace=self.workspaces[layer], backend=self.backend)
        return out.to(q.dtype)


class QuestStore(DenseStore):
    """A dense store whose layers from ``read.dense_layers`` on read only the selected pages."""

    rewinds = False  # a page's key bounds widen with every token written, and never shrink back

    def __init__(self, layout: Layout, read: quest.QuestRead, num_heads: int, dtype, device, scale: float,
                 attention: str = "auto", backend: str = "auto"):
        super().__init__(layout, dtype, device, scale, attention)
        self.read, self.backend = read, backend
        self.kv_format = f"model dtype, {read.label}"
        spec, b, h, d = read.spec, layout.batch, layout.kv_heads, layout.head_dim
        self.bounds = [quest.alloc_bounds(spec, b, h, c, d, dtype, device) for c in layout.capacity]
        kernel = uses_kernel(backend, device)
        self.quest_workspaces = [
            make_quest_workspace(num_heads, b, h, spec.selected(bounds.capacity), d, device, page=spec.page)
            if kernel and i >= read.dense_layers else None for i, bounds in enumerate(self.bounds)]

    def bytes_allocated(self) -> int:
        return super().bytes_allocated() + sum(t.numel() * t.element_size() for bd in self.bounds
                                               for t in (bd.kmin, bd.kmax))

    def buffers(self) -> list[torch.Tensor]:
        return [*super().buffers(), *(t for bd in self.bounds for t in (bd.kmin, bd.kmax))]

    def held_bytes(self, held: list[int]) -> int:
        """K/V plus the bounds of the pages holding tokens."""
        bd = self.bounds[0].kmin
        per_page = 2 * self.layout.batch * self.layout.kv_heads * self.layout.head_dim * bd.element_size()
        return super().held_bytes(held) + sum(self.read.spec.pages(n) for n in held) * per_page

    def _load_layer(self, layer: int, rows: slice, k: torch.Tensor, v: torch.Tensor) -> None:
        super()._load_layer(layer, rows, k, v)
        bounds = self.bounds[layer]
        quest.load_bounds(quest.PageBounds(bounds.spec, bounds.kmin[rows], bounds.kmax[rows]), k)

    def _attend(self, layer: int, q, k, v) -> torch.Tensor:
        if layer < self.read.dense_layers:
            return super()._attend(layer, q, k, v)
        slot, used = self.slots.slot(layer), self.slots.used(layer)
        self.keys[layer].index_copy_(2, slot, k)
        self.values[layer].index_copy_(2, slot, v)
        quest.append_bounds(self.bounds[layer], k, slot, backend=self.backend)
        bsz, n_heads, _, dim = q.shape
        q3 = q.reshape(bsz, n_heads, dim).contiguous()
        with record_function(SCOPE_SELECT):
            pages = quest.select_pages(q3, self.bounds[layer], used, backend=self.backend)
        out = quest_decode_attention(q3, self.keys[layer], self.values[layer], pages, used, self.scale,
                                     self.read.spec.page, token_dim=2, workspace=self.quest_workspaces[layer],
                                     backend=self.backend)
        return out.to(q.dtype)


def uses_kernel(backend: str, device) -> bool:
    """Whether the kernels' ``backend`` runs Triton here (``auto``: on CUDA devices)."""
    return backend == "triton" or (backend == "auto" and torch.device(device).type == "cuda")


def read_store(layout: Layout, kv_format, num_heads: int, dtype, device, scale: float, attention: str = "auto",
               backend: str = "auto"):
    """The store for a ``fast_storage()`` format that is not a format name: a KIVI spec or a Quest read.
    ``backend``: the kernels' (``auto``: Triton on CUDA, the torch reference elsewhere; ``triton`` on
    CPU runs the interpreter, with ``TRITON_INTERPRET=1``)."""
    if isinstance(kv_format, kivi.KiviSpec):
        return KiviSlotStore(layout, kv_format, num_heads, device, scale, backend)
    if isinstance(kv_format, quest.QuestRead):
        return QuestStore(layout, kv_format, num_heads, dtype, device, scale, attention, backend)
    raise TypeError(f"no fast-engine store for {kv_format!r}")
