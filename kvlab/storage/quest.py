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

``format``: ``model-dtype`` (the above) or a kvq format (``int4-g64``, ``fp8``, ...): K/V are then kept as
kvq codes (key offset ``prompt-mean``, as kvq's stores) while the page bounds still come from the exact
keys; hf: :class:`QuantizedQuestLayer` (the prefill attends exactly, then kvq's semantics), fast:
:class:`QuantizedQuestStore`, which gathers and dequantizes only the selected pages' codes. Both are
torch: the sparse kernel reads model-dtype pages, so the combination is refused on CUDA.

Serving: :class:`QuestPool`, every block kept at the model dtype and each block's key min and max
beside the pool (``kmin``/``kmax [layers, blocks, Hkv, D]``, folded in as slots are written; a block's
first slot replaces them). A page is one block (``block_size`` = ``page``), so a request's page bounds
are its block table's rows of ``kmin``/``kmax`` and the paged layout (K/V plus one min and max per
page) is exactly what a block weighs. Rows of a chunk past the prompt read as the decode step reads
them (:mod:`kvlab.kernels.quest`'s torch reference): the first page, the latest, then the top-bound
pages up to the budget; ``quest_attend`` for one row, ``chunk_attend`` row by row for generated tokens
re-fed after a preemption. Prompt rows and the first ``dense_layers`` layers attend densely.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.profiler import record_function
from transformers.cache_utils import Cache, DynamicLayer

from kvlab.anatomy import SCOPE_SELECT
from kvlab.errors import EngineError, PolicyError
from kvlab.kernels import parse_format, quantize_write, quest
from kvlab.kernels.formats import FormatError
from kvlab.kernels.key_offset import DEFAULT_KEY_OFFSET
from kvlab.kernels.quest_decode import kernel_problem, make_quest_workspace, quest_decode_attention
from kvlab.storage import attention
from kvlab.storage.base import ModelShape, StorageLayer, StoreOptions, check_int
from kvlab.storage.dense import DensePool, DenseStore
from kvlab.storage.kvq import KVQLayer, QuantizedStore, offset_label
from kvlab.storage.loading import PromptStorage
from kvlab.storage.paged import PoolShape, attend
from kvlab.storage.slots import Layout, uses_kernel

GROUP_REDUCE = ("max", "sum")
DENSE = "model-dtype"  # the format that keeps K/V at the model dtype (the default)


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
        self._read: tuple[torch.Tensor, torch.Tensor] | None = None  # the K/V that update returned: what attend reads
        self.kmin: torch.Tensor | None = None  # [B, H, pages, D]
        self.kmax: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        prefill = not self.is_initialized or self.prompt_left > 0
        start = self.get_seq_length() if self.is_initialized else 0
        keys, values = self._store(key_states, value_states, prefill, *args, **kwargs)
        self._fold(key_states, start)
        self.prompt_left = max(0, self.prompt_left - key_states.shape[-2])
        if self.sparse and not prefill:  # decode or a chunk after the prefill: kvlab's attention hands us the queries
            self._returned, self._read = keys, (keys, values)
            attention.expect_queries(self.layer_idx, self)
        return keys, values

    def _store(self, key_states: torch.Tensor, value_states: torch.Tensor, prefill: bool, *args, **kwargs):
        """Keep the new K/V; what attention reads (here: every token at the model dtype)."""
        return DynamicLayer.update(self, key_states, value_states, *args, **kwargs)

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
        self._returned = self._read = None

    def _fold(self, new: torch.Tensor, start: int) -> None:
        """Fold the exact keys at positions ``start ..`` into the bounds of the pages they touch."""
        end = start + new.shape[2]
        pages = self.spec.pages(end)
        if self.kmin is None or self.kmin.shape[2] < pages:
            grow = max(pages, 2 * (0 if self.kmin is None else self.kmin.shape[2]))
            b, h, _, d = new.shape
            kmin = new.new_full((b, h, grow, d), float("inf"))
            kmax = new.new_full((b, h, grow, d), float("-inf"))
            if self.kmin is not None:
                kmin[:, :, :self.kmin.shape[2]] = self.kmin
                kmax[:, :, :self.kmax.shape[2]] = self.kmax
            self.kmin, self.kmax = kmin, kmax
        quest.fold_bounds(quest.PageBounds(self.spec, self.kmin, self.kmax), new, start)

    def bounds(self) -> quest.PageBounds:
        pages = -(-self.get_seq_length() // self.spec.page)
        return quest.PageBounds(self.spec, self.kmin[:, :, :pages], self.kmax[:, :, :pages])

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Quest's read for the queries ``[B, Hq, n, D]`` of the last ``n`` tokens -> ``[B, n, Hq, D]``
        (the layout transformers' attention functions return), in the query's dtype: one decode
        query, or a chunk read row by row as its tokens decoded one at a time would be."""
        (keys, values), self._returned, self._read = self._read or (self.keys, self.values), None, None
        b, hq, n, d = query.shape
        if n > 1:
            out = quest.chunk_attend(query, keys, values, self.bounds(), scaling)
            return out.transpose(1, 2).to(query.dtype).contiguous()
        lengths = torch.full((b,), self.get_seq_length(), device=query.device)
        out = quest.quest_attend(query[:, :, 0], keys, values, self.bounds(), lengths, scaling)
        return out.to(query.dtype).view(b, 1, hq, d)

    @property
    def physical_tokens(self) -> int:
        return self.get_seq_length() if self.is_initialized else 0

    def nbytes(self) -> int:
        """K/V and the bounds of the pages holding tokens (``cache_stats`` counts this)."""
        if not self.is_initialized or self.kmin is None:
            return 0
        pages = -(-self.get_seq_length() // self.spec.page)
        return self._kv_bytes() + 2 * self.kmin[:, :, :pages].numel() * self.kmin.element_size()

    def _kv_bytes(self) -> int:
        return (self.keys.numel() + self.values.numel()) * self.keys.element_size()

    def reset(self) -> None:
        super().reset()
        self.kmin = self.kmax = self._returned = self._read = None
        self.prompt_left = 0


class QuantizedQuestLayer(QuestLayer):
    """A :class:`QuestLayer` whose K/V are kept in a kvq format (:class:`~kvlab.storage.kvq.KVQLayer`,
    key offset ``prompt-mean``) once the prompt is in: the prefill attends its exact K/V (every chunk
    of a chunked one), the whole prompt is then quantized, and every later token is quantized before
    it attends, itself included (kvq's semantics). The page bounds fold the exact keys; attention
    reads the dequantized store (dense layers) or its selected pages (:meth:`attend`)."""

    def __init__(self, kv_format: str, spec: quest.QuestSpec | None = None, layer_idx: int = 0, dense_layers: int = 2):
        super().__init__(spec, layer_idx, dense_layers)
        self.codes = KVQLayer(kv_format, DEFAULT_KEY_OFFSET)

    def _store(self, key_states: torch.Tensor, value_states: torch.Tensor, prefill: bool, *args, **kwargs):
        if prefill:
            return DynamicLayer.update(self, key_states, value_states, *args, **kwargs)
        if not self.codes.is_initialized:  # the prompt is in: quantize it (its key offset fitted on it)
            self.codes.update(self.keys, self.values)
            self.keys, self.values = self.keys[:, :, :0].clone(), self.values[:, :, :0].clone()
        return self.codes.update(key_states, value_states)

    def get_seq_length(self) -> int:
        return self.codes.stored_tokens if self.codes.is_initialized else super().get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def _kv_bytes(self) -> int:
        return super()._kv_bytes() + self.codes.nbytes()

    def reset(self) -> None:
        super().reset()
        self.codes.reset()


def quest_cache(num_layers: int, spec: quest.QuestSpec | None = None, dense_layers: int = 2,
                kv_format: str = DENSE) -> Cache:
    """A transformers cache of :class:`QuestLayer` s (the first ``dense_layers`` never read sparsely),
    :class:`QuantizedQuestLayer` s for a kvq ``kv_format``."""
    if kv_format == DENSE:
        return Cache(layers=[QuestLayer(spec, i, dense_layers) for i in range(num_layers)])
    return Cache(layers=[QuantizedQuestLayer(kv_format, spec, i, dense_layers) for i in range(num_layers)])


class PageBoundsStore:
    """What both fast Quest stores add to theirs (a cooperative mixin in front of a
    :class:`~kvlab.storage.slots.SlotStore`): per layer the page bounds of the exact keys, their
    bytes and buffers, filled on load, appended and ranked on each sparse step."""

    read: quest.QuestRead
    backend: str
    rewinds = False  # a page's key bounds widen with every token written, and never shrink back

    def _init_bounds(self, layout: Layout, dtype, device) -> None:
        spec, b, h, d = self.read.spec, layout.batch, layout.kv_heads, layout.head_dim
        self.bounds = [quest.alloc_bounds(spec, b, h, c, d, dtype, device) for c in layout.capacity]

    def _bounds_tensors(self) -> list[torch.Tensor]:
        return [t for bd in self.bounds for t in (bd.kmin, bd.kmax)]

    def bytes_allocated(self) -> int:
        return super().bytes_allocated() + sum(t.numel() * t.element_size() for t in self._bounds_tensors())

    def buffers(self) -> list[torch.Tensor]:
        return [*super().buffers(), *self._bounds_tensors()]

    def held_bytes(self, held: list[int]) -> int:
        """The store's bytes plus the bounds of the pages holding tokens."""
        bd = self.bounds[0].kmin
        per_page = 2 * self.layout.batch * self.layout.kv_heads * self.layout.head_dim * bd.element_size()
        return super().held_bytes(held) + sum(self.read.spec.pages(n) for n in held) * per_page

    def _load_layer(self, layer: int, rows: slice, k: torch.Tensor, v: torch.Tensor) -> None:
        super()._load_layer(layer, rows, k, v)
        bounds = self.bounds[layer]
        quest.load_bounds(quest.PageBounds(bounds.spec, bounds.kmin[rows], bounds.kmax[rows]), k)

    def _select(self, layer: int, q3: torch.Tensor, k: torch.Tensor, slot: torch.Tensor, used: torch.Tensor):
        """Fold this step's exact key into its page's bounds; the pages ``q3 [B, Hq, D]`` reads."""
        quest.append_bounds(self.bounds[layer], k, slot, backend=self.backend)
        with record_function(SCOPE_SELECT):
            return quest.select_pages(q3, self.bounds[layer], used, backend=self.backend)


class QuestStore(PageBoundsStore, DenseStore):
    """A dense store whose layers from ``read.dense_layers`` on read only the selected pages."""

    def __init__(self, layout: Layout, read: quest.QuestRead, num_heads: int, dtype, device, scale: float,
                 attention: str = "auto", backend: str = "auto"):
        super().__init__(layout, dtype, device, scale, attention)
        self.read, self.backend = read, backend
        self.kv_format = f"model dtype, {read.label}"
        self._init_bounds(layout, dtype, device)
        spec, b, h, d = read.spec, layout.batch, layout.kv_heads, layout.head_dim
        kernel = uses_kernel(backend, device)
        self.quest_workspaces = [
            make_quest_workspace(num_heads, b, h, spec.selected(bounds.capacity), d, device, page=spec.page)
            if kernel and i >= read.dense_layers else None for i, bounds in enumerate(self.bounds)]

    def _attend(self, layer: int, q, k, v) -> torch.Tensor:
        if layer < self.read.dense_layers:
            return super()._attend(layer, q, k, v)
        slot, used = self.slots.slot(layer), self.slots.used(layer)
        self.keys[layer].index_copy_(2, slot, k)
        self.values[layer].index_copy_(2, slot, v)
        bsz, n_heads, _, dim = q.shape
        q3 = q.reshape(bsz, n_heads, dim).contiguous()
        pages = self._select(layer, q3, k, slot, used)
        out = quest_decode_attention(q3, self.keys[layer], self.values[layer], pages, used, self.scale,
                                     self.read.spec.page, token_dim=2, workspace=self.quest_workspaces[layer],
                                     backend=self.backend)
        return out.to(q.dtype)


class QuantizedQuestStore(PageBoundsStore, QuantizedStore):
    """A kvq store (key offset ``prompt-mean``) whose layers from ``read.dense_layers`` on read only the
    selected pages' codes (:func:`kvlab.kernels.quest.sparse_attend_codes`, torch: the sparse kernel
    reads model-dtype pages only, so this store runs where the kernels do not)."""

    def __init__(self, layout: Layout, read: quest.QuestRead, kv_format: str, num_heads: int, dtype, device,
                 scale: float, backend: str = "auto"):
        if uses_kernel(backend, device):
            raise EngineError(f"quest with format={kv_format} has no kernel (the sparse kernel reads model-dtype "
                              "pages): run it on a CPU, or use format=model-dtype on a GPU")
        super().__init__(layout, kv_format, num_heads, dtype, device, scale, "fused", DEFAULT_KEY_OFFSET)
        self.read, self.backend = read, backend
        self.kv_format = f"{self.kv_format}, {read.label}"
        self._init_bounds(layout, dtype, device)

    def _attend(self, layer: int, q, k, v) -> torch.Tensor:
        if layer < self.read.dense_layers:
            return super()._attend(layer, q, k, v)
        slot, used = self.slots.slot(layer), self.slots.used(layer)
        quantize_write(self.keys[layer], k, slot, offset=self.key_offsets[layer])
        quantize_write(self.values[layer], v, slot)
        bsz, n_heads, _, dim = q.shape
        q3 = q.reshape(bsz, n_heads, dim).contiguous()
        pages = self._select(layer, q3, k, slot, used)
        out = quest.sparse_attend_codes(q3, self.keys[layer], self.values[layer], pages, used, self.scale,
                                        self.read.spec.page)
        return out.to(q.dtype)


class QuestPool(DensePool):
    """A dense pool plus per-block key bounds; decode rows of sparse layers read the selected pages."""

    paged_kernel = False  # the Triton paged decode reads every block; the sparse read is the torch reference here
    captures_decode = False

    def __init__(self, read: quest.QuestRead, shape: PoolShape, dtype: torch.dtype, device):
        super().__init__(shape, dtype, device)
        self.quest, self.block_size = read, shape.block_size
        size = (shape.num_layers, shape.num_blocks, shape.kv_heads, shape.head_dim)
        self.kmin = torch.full(size, float("inf"), dtype=dtype, device=device)
        self.kmax = torch.full(size, float("-inf"), dtype=dtype, device=device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, owner: int = 0,
              first: bool = False) -> None:
        super().write(layer, slots, k, v, owner, first)
        slots = slots.to(self.kmin.device)
        blocks = slots // self.block_size
        fresh = blocks[slots % self.block_size == 0]  # a block's first slot: a new owner, or a new page
        self.kmin[layer, fresh] = float("inf")
        self.kmax[layer, fresh] = float("-inf")
        keys = k.to(self.dtype)
        where = blocks.view(-1, 1, 1).expand_as(keys)
        self.kmin[layer].scatter_reduce_(0, where, keys, "amin")
        self.kmax[layer].scatter_reduce_(0, where, keys, "amax")

    def page_bounds(self, layer: int, held: torch.Tensor) -> quest.PageBounds:
        """The bounds ``[1, Hkv, pages, D]`` of the request whose held slots are ``held`` (token order)."""
        blocks = (held[::self.block_size] // self.block_size).to(self.kmin.device)
        kmin, kmax = self.kmin[layer, blocks], self.kmax[layer, blocks]  # [pages, Hkv, D]
        return quest.PageBounds(self.quest.spec, kmin.transpose(0, 1)[None], kmax.transpose(0, 1)[None])

    def attend(self, layer: int, q: torch.Tensor, held: torch.Tensor, scale: float, decode_from: int) -> torch.Tensor:
        n = q.shape[1]
        if layer < self.quest.dense_layers or decode_from >= n:
            return super().attend(layer, q, held, scale, decode_from)
        keys, values = self.read(layer, held)  # [Hkv, m, D]
        m = keys.shape[1]
        parts = []
        if decode_from > 0:  # prompt rows of the chunk: dense, causal over the slots up to each
            upto = m - (n - decode_from)
            parts.append(attend(q[:, :decode_from], keys[:, :upto], values[:, :upto], scale))
        bounds = self.page_bounds(layer, held)
        rows = q[:, decode_from:]
        if rows.shape[1] == 1:
            lengths = torch.full((1,), m, device=q.device)
            out = quest.quest_attend(rows[None, :, 0], keys[None], values[None], bounds, lengths, scale)[0][:, None]
        else:
            out = quest.chunk_attend(rows[None], keys[None], values[None], bounds, scale)[0]
        parts.append(out.to(q.dtype))
        return torch.cat(parts, 1)


@dataclass(frozen=True)
class QuestStorage(PromptStorage):
    """Quest's knobs; its label, checks, and both engines' halves."""

    name = "quest"
    summary = ("Quest-style sparse read: the whole cache kept, each decode step reads the pages a key "
               "min/max bound ranks highest for the query (fast: sparse kernel)")
    attends_own_queries = True  # the attention wrapper hands a decode query to QuestLayer.attend
    prefill = None  # the prompt enters whole; the store loads it from a plain prefill cache

    page: int = field(default=16, metadata={"help": "tokens per page (a power of two; the CUDA kernel needs >= 16)"})
    budget: int = field(default=2048, metadata={
        "help": "tokens read per decode step (whole pages, at least 2: the first and the latest are always read)"})
    group_reduce: str = field(default="max", metadata={
        "help": "how a KV head's query heads rank pages together: max or sum of their bounds"})
    dense_layers: int = field(default=2, metadata={"help": "leading layers that read the whole cache (Quest: 2)"})
    format: str = field(default=DENSE, metadata={
        "help": f"{DENSE} (K/V at the model dtype) or a kvq format the pages are read from (fp8, int4-g64, "
                "int2-g32, ...: CPU only, the sparse kernel reads model-dtype pages)", "omit_default": True})

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
        if self.format != DENSE:
            try:
                parse_format(str(self.format))
            except FormatError as err:
                raise PolicyError(f"format={self.format!r} is not a quest format ({err}): use {DENSE} or a kvq "
                                  "format such as fp8, int4-g64 or int2-g32") from None

    @property
    def quantized(self) -> bool:
        return self.format != DENSE

    @property
    def bits(self) -> int | None:
        return parse_format(self.format).bits if self.quantized else None

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
        extra += f" {self.format}" if self.quantized else ""
        return f"quest {self.budget}{extra}"

    @property
    def kv_format(self) -> str:
        stored = offset_label(parse_format(self.format).label, DEFAULT_KEY_OFFSET) if self.quantized else "model dtype"
        return f"{stored}, {self.read.label}"

    def check(self, shape: ModelShape, cuda: bool) -> None:
        shape.check_full_attention("quest reads")
        if self.dense_layers > shape.num_layers:
            raise PolicyError(f"dense_layers={self.dense_layers} exceeds {shape.name}'s {shape.num_layers} layers")
        if self.quantized:
            try:
                parse_format(self.format).check_head_dim(shape.head_dim)
            except FormatError as err:
                raise PolicyError(f"quest format={self.format} cannot store {shape.name}: {err}") from None
            if cuda:
                raise PolicyError(f"quest format={self.format} has no CUDA kernel (the sparse kernel reads "
                                  f"model-dtype pages): use format={DENSE} on a GPU, or run it on a CPU")
        why = kernel_problem(shape.head_dim, self.page)
        if why and cuda:
            raise PolicyError(f"quest's CUDA kernel cannot read {shape.name}: {why}")

    def make_cache(self, num_layers: int) -> Cache:
        return quest_cache(num_layers, self.spec, self.dense_layers, self.format)

    def token_bytes(self, kv_heads: int, head_dim: int, element_size: int = 2) -> float:
        """K/V (model dtype, or the format's codes and scales) plus each page's key min and max
        (model dtype), per token."""
        bounds = 2 * kv_heads * head_dim * element_size / self.page
        if self.quantized:
            return 2 * parse_format(self.format).bytes_per_token(kv_heads, head_dim) + bounds
        return 2 * kv_heads * head_dim * element_size + bounds

    def store(self, layout: Layout, options: StoreOptions):
        if self.quantized:
            return QuantizedQuestStore(layout, self.read, self.format, options.num_heads, options.dtype,
                                       options.device, options.scale, options.backend)
        attention = "auto" if options.attention == "triton" else options.attention
        return QuestStore(layout, self.read, options.num_heads, options.dtype, options.device, options.scale,
                          attention, options.backend)

    def paged_pool(self, shape: PoolShape, dtype: torch.dtype, device) -> QuestPool:
        return QuestPool(self.read, shape, dtype, device)

    def block_size_problem(self, block_size: int) -> str | None:
        """A page is one pool block (its bounds sit beside the pool, one min and max per block)."""
        if self.page == block_size:
            return None
        return (f"quest pages of {self.page} tokens are stored in pool blocks of {block_size}: serve it with "
                f"block_size={self.page} (one block each), or page={block_size}")
