"""The quest family: Quest-style query-aware sparse read (:mod:`kvlab.kernels.quest`). The whole cache
is kept at the model dtype, with each page's key min/max beside it; each decode step reads only the
``budget`` tokens of the pages whose bounds rank the query's attention highest (the first and the
latest page always). It saves bytes read, not memory. Tang et al. 2024, github.com/mit-han-lab/Quest.

``hf``: :class:`QuestLayer` is a ``DynamicLayer`` (K/V kept whole, returned whole) that also keeps the
page bounds of :mod:`kvlab.kernels.quest`, folded in on every update. transformers' cache interface
never sees the query, so the sparse read happens in the attention function: for a decode step
(one query token) of a layer at or past ``dense_layers`` (Quest keeps the first two layers dense),
the function calls :meth:`QuestLayer.attend` instead of the stock kernel. The prefill (the first
update, or every chunk of a chunked prefill) attends densely, as Quest's own code does; a
multi-token chunk after it (a question, a teacher-forced answer or continuation) is read row by
row as decoding its tokens one at a time would read them (:func:`kvlab.kernels.quest.chunk_attend`),
so teacher-forced fidelity measures the sparse read. The hook belongs in kvlab's registered
attention wrapper (:mod:`kvlab.storage.attention`), which already hands queries to cache layers.

``fast``: :class:`QuestStore`, a :class:`~kvlab.storage.dense.DenseStore` plus page bounds: layers
below ``dense_layers`` attend densely; the others select pages from the query (inside the profiler
scope ``kvlab::quest_select``, so the anatomy shows the selection's own cost on eager steps; on CUDA
the bounds' append is one kernel and the selection two, :mod:`kvlab.kernels.quest_bounds` and
:mod:`kvlab.kernels.quest_select`) and read only those (``quest_decode_attention``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.profiler import record_function
from transformers.cache_utils import Cache, DynamicLayer

from kvlab.anatomy import SCOPE_SELECT
from kvlab.errors import PolicyError
from kvlab.kernels import quest
from kvlab.kernels.quest_decode import kernel_problem, make_quest_workspace, quest_decode_attention
from kvlab.storage import attention
from kvlab.storage.base import ModelShape, StorageLayer, StoreOptions, check_int
from kvlab.storage.dense import DenseStore
from kvlab.storage.loading import PromptStorage
from kvlab.storage.slots import Layout, uses_kernel

GROUP_REDUCE = ("max", "sum")


class QuestLayer(StorageLayer, DynamicLayer):
    """Whole K/V plus ``kmin``/``kmax`` per page of ``spec.page`` tokens and KV head."""

    def __init__(self, spec: quest.QuestSpec | None = None, layer_idx: int = 0, dense_layers: int = 2):
        super().__init__()
        self.spec = spec or quest.QuestSpec()
        self.layer_idx = layer_idx
        self.sparse = layer_idx >= dense_layers
        self.attends_own_queries = self.sparse  # kvlab's attention wrapper hands this layer its queries
        self.prompt_left = 0  # tokens of a chunked prefill still to come (they attend densely)
        self._returned: torch.Tensor | None = None  # the keys a decode update returned, for the attention hook
        self.kmin: torch.Tensor | None = None  # [B, H, pages, D]
        self.kmax: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        prefill = not self.is_initialized or self.prompt_left > 0
        start = self.get_seq_length() if self.is_initialized else 0
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        self._fold(key_states, start)
        self.prompt_left = max(0, self.prompt_left - key_states.shape[-2])
        if self.sparse and not prefill:  # decode or a chunk after the prefill: kvlab's attention hands us the queries
            self._returned = keys
            attention.expect_queries(self.layer_idx, self)
        return keys, values

    def begin_stream(self, prompt_length: int) -> None:
        """A chunked prefill of ``prompt_length`` tokens starts: its chunks attend densely (Quest's
        prefill, and the fast engine's, is dense)."""
        self.prompt_left = prompt_length

    def end_stream(self) -> None:
        self.prompt_left = 0

    def awaits(self, key: torch.Tensor) -> bool:
        """Whether ``key`` is the tensor this layer's last decode update returned."""
        return self._returned is not None and self._returned is key

    def receive_queries(self, query: torch.Tensor, attention_mask, scaling) -> None:
        """Called only for queries the wrapper did not hand to :meth:`attend` (more than one token)."""
        self._returned = None

    def _fold(self, new: torch.Tensor, start: int) -> None:
        """Fold keys at positions ``start ..`` into the bounds: the pages they touch are recomputed
        from the stored keys (the partial last page included)."""
        page = self.spec.page
        first, end = start // page, self.keys.shape[2]
        pages = -(-end // page)
        if self.kmin is None or self.kmin.shape[2] < pages:
            grow = max(pages, 2 * (0 if self.kmin is None else self.kmin.shape[2]))
            b, h, _, d = self.keys.shape
            kmin = self.keys.new_full((b, h, grow, d), float("inf"))
            kmax = self.keys.new_full((b, h, grow, d), float("-inf"))
            if self.kmin is not None:
                kmin[:, :, :self.kmin.shape[2]] = self.kmin
                kmax[:, :, :self.kmax.shape[2]] = self.kmax
            self.kmin, self.kmax = kmin, kmax
        view = quest.PageBounds(self.spec, self.kmin[:, :, first:], self.kmax[:, :, first:])
        quest.load_bounds(view, self.keys[:, :, first * page:end])

    def bounds(self) -> quest.PageBounds:
        pages = -(-self.get_seq_length() // self.spec.page)
        return quest.PageBounds(self.spec, self.kmin[:, :, :pages], self.kmax[:, :, :pages])

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Quest's read for the queries ``[B, Hq, n, D]`` of the last ``n`` tokens -> ``[B, n, Hq, D]``
        (the layout transformers' attention functions return), in the query's dtype: one decode
        query, or a chunk read row by row as its tokens decoded one at a time would be."""
        self._returned = None
        b, hq, n, d = query.shape
        if n > 1:
            out = quest.chunk_attend(query, self.keys, self.values, self.bounds(), scaling)
            return out.transpose(1, 2).to(query.dtype).contiguous()
        lengths = torch.full((b,), self.get_seq_length(), device=query.device)
        out = quest.quest_attend(query[:, :, 0], self.keys, self.values, self.bounds(), lengths, scaling)
        return out.to(query.dtype).view(b, 1, hq, d)

    @property
    def physical_tokens(self) -> int:
        return self.get_seq_length() if self.is_initialized else 0

    def nbytes(self) -> int:
        """K/V and the bounds of the pages holding tokens (``cache_stats`` counts this)."""
        if not self.is_initialized or self.kmin is None:
            return 0
        pages = -(-self.get_seq_length() // self.spec.page)
        kv = (self.keys.numel() + self.values.numel()) * self.keys.element_size()
        return kv + 2 * self.kmin[:, :, :pages].numel() * self.kmin.element_size()

    def reset(self) -> None:
        super().reset()
        self.kmin = self.kmax = self._returned = None
        self.prompt_left = 0


def quest_cache(num_layers: int, spec: quest.QuestSpec | None = None, dense_layers: int = 2) -> Cache:
    """A transformers cache of :class:`QuestLayer` s (the first ``dense_layers`` never read sparsely)."""
    return Cache(layers=[QuestLayer(spec, i, dense_layers) for i in range(num_layers)])


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


@dataclass(frozen=True)
class QuestStorage(PromptStorage):
    """Quest's knobs; its label, checks, and both engines' halves."""

    name = "quest"
    summary = ("Quest-style sparse read: the whole cache kept, each decode step reads the pages a key "
               "min/max bound ranks highest for the query (fast: sparse kernel)")
    attends_own_queries = True  # the attention wrapper hands a decode query to QuestLayer.attend
    prefill = None  # the prompt enters whole; the store loads it from a plain prefill cache
    bits = None

    page: int = field(default=16, metadata={"help": "tokens per page (a power of two; the CUDA kernel needs >= 16)"})
    budget: int = field(default=2048, metadata={
        "help": "tokens read per decode step (whole pages, at least 2: the first and the latest are always read)"})
    group_reduce: str = field(default="max", metadata={
        "help": "how a KV head's query heads rank pages together: max or sum of their bounds"})
    dense_layers: int = field(default=2, metadata={"help": "leading layers that read the whole cache (Quest: 2)"})

    def __post_init__(self):
        check_int("page", self.page, minimum=1)
        if self.page & (self.page - 1):
            raise PolicyError(f"page must be a power of two (16 is Quest's), got {self.page}")
        check_int("budget", self.budget)
        if self.budget < 2 * self.page:
            raise PolicyError(f"budget={self.budget} tokens must hold two pages of {self.page} (the first and the "
                              f"latest are always read): use >= {2 * self.page}")
        if self.group_reduce not in GROUP_REDUCE:
            raise PolicyError(f"group_reduce={self.group_reduce!r} is not supported: use one of {', '.join(GROUP_REDUCE)}")
        check_int("dense_layers", self.dense_layers, minimum=0)

    @property
    def spec(self) -> quest.QuestSpec:
        return quest.QuestSpec(self.page, self.budget, self.group_reduce)

    @property
    def read(self) -> quest.QuestRead:
        return quest.QuestRead(self.spec, self.dense_layers)

    @property
    def label(self) -> str:
        extra = "".join(f" {k}{v}" for k, v, default in (("p", self.page, 16), ("d", self.dense_layers, 2))
                        if v != default)
        extra += "" if self.group_reduce == "max" else f" {self.group_reduce}"
        return f"quest {self.budget}{extra}"

    @property
    def kv_format(self) -> str:
        return f"model dtype, {self.read.label}"

    def check(self, shape: ModelShape, cuda: bool) -> None:
        shape.check_full_attention("quest reads")
        if self.dense_layers > shape.num_layers:
            raise PolicyError(f"dense_layers={self.dense_layers} exceeds {shape.name}'s {shape.num_layers} layers")
        why = kernel_problem(shape.head_dim, self.page)
        if why and cuda:
            raise PolicyError(f"quest's CUDA kernel cannot read {shape.name}: {why}")

    def make_cache(self, num_layers: int) -> Cache:
        return quest_cache(num_layers, self.spec, self.dense_layers)

    def token_bytes(self, kv_heads: int, head_dim: int, element_size: int = 2) -> float:
        """K/V at the model dtype plus each page's key min and max, per token."""
        return 2 * kv_heads * head_dim * element_size * (1 + 1 / self.page)

    def store(self, layout: Layout, options: StoreOptions):
        attention = "auto" if options.attention == "triton" else options.attention
        return QuestStore(layout, self.read, options.num_heads, options.dtype, options.device, options.scale,
                          attention, options.backend)



