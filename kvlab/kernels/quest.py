"""Quest-style query-aware sparse reads (Tang et al. 2024, github.com/mit-han-lab/Quest), pure torch:
the ground truth of the sparse kernel (:mod:`kvlab.kernels.quest_decode`) and the CPU path.

The cache is kept whole; beside it, per page of ``page`` tokens and KV head, the element-wise min and
max of the keys (:class:`PageBounds`, updated on append). Each decode step bounds every page's
attention logit from the query (``sum_d max(q_d * min_d, q_d * max_d) >= q . k`` for every key of the
page, as Quest's ``estimate`` kernel and ``evaluation/quest_attention.py``), always reads the first
page (the attention sink) and the latest (the current token's), and fills the rest of the budget
with the top-bound pages; attention then runs over the selected pages only.

GQA: Quest's code is written for one query head per KV head (its evaluation repeats K/V per query
head, so every query head picks its own pages). Here ``group_reduce`` says how a KV head's group of
query heads picks one page set that all of them read (the point of GQA: the pages are read once for
the group): ``"max"`` (default) ranks a page by its highest bound over the group's heads, so a
page any head may attend to strongly ranks high; ``"sum"`` by the sum of the bounds (an upper bound
of the group's summed logit). ``"head"`` is Quest's own choice, a page set per query head (the
reference reads it; the kernel reads one set per KV head).

Selection is fixed-shape (the top ``k``, a constant of the store): pages past a row's length get
``-inf`` and come back as index ``-1`` when fewer pages exist than ``k``; readers skip them. On CUDA
(``backend`` ``"auto"`` or ``"triton"``) the decode step's selection (one query per row,
``group_reduce`` max or sum) is two Triton kernels (:mod:`kvlab.kernels.quest_select`: the scores
:func:`reference_scores` computes, then the top pages in place of ``topk``) and the bounds' append
one more (:mod:`kvlab.kernels.quest_bounds`), where torch takes about 25 small kernels per layer;
``benchmarks/quest_select.py`` times both paths on a GPU. The torch functions here are their
reference and the CPU path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvlab.kernels.formats import FormatError, KVStore

GROUP_REDUCE = ("max", "sum", "head")
SELECT_BACKENDS = ("auto", "triton", "reference")


@dataclass(frozen=True)
class QuestSpec:
    """``page`` tokens per page (Quest's scripts: 16), ``budget`` tokens read per step (a multiple of
    pages, the first and latest included), ``group_reduce`` (see the module doc)."""

    page: int = 16
    budget: int = 2048
    group_reduce: str = "max"

    def __post_init__(self):
        if self.page < 1 or self.page & (self.page - 1):
            raise FormatError(f"Quest page must be a power of two, not {self.page!r}")
        if self.budget < 2 * self.page:
            raise FormatError(f"Quest budget {self.budget} must hold at least two pages of {self.page} "
                              "(the first and the latest are always read)")
        if self.group_reduce not in GROUP_REDUCE:
            raise FormatError(f"group_reduce must be one of {', '.join(GROUP_REDUCE)}, not {self.group_reduce!r}")

    @property
    def pages_per_step(self) -> int:
        return self.budget // self.page

    def pages(self, length: int) -> int:
        return math.ceil(length / self.page)

    def selected(self, capacity: int) -> int:
        """Pages a step selects (a constant of the store: ``k`` of the ``topk``)."""
        return min(self.pages(capacity), self.pages_per_step)


@dataclass(frozen=True)
class QuestRead:
    """What the fast engine's Quest store needs: the page spec and how many leading layers read densely
    (Quest keeps the first two layers dense)."""

    spec: QuestSpec
    dense_layers: int = 2

    @property
    def label(self) -> str:
        s = self.spec
        return f"quest p{s.page}-b{s.budget}-{s.group_reduce}-d{self.dense_layers}"


@dataclass
class PageBounds:
    """``kmin``/``kmax [B, H, pages, D]`` (the keys' dtype) of a cache of ``pages * page`` slots."""

    spec: QuestSpec
    kmin: torch.Tensor
    kmax: torch.Tensor

    @property
    def capacity(self) -> int:
        return self.kmin.shape[2] * self.spec.page


def alloc_bounds(spec: QuestSpec, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype=torch.bfloat16,
                 device: torch.device | str = "cpu") -> PageBounds:
    shape = (batch, kv_heads, spec.pages(capacity), head_dim)
    return PageBounds(spec, torch.full(shape, float("inf"), dtype=dtype, device=device),
                      torch.full(shape, float("-inf"), dtype=dtype, device=device))


def load_bounds(bounds: PageBounds, keys: torch.Tensor) -> None:
    """Bounds of a prefill's ``[B, H, n, D]`` keys (pages ``0 .. ceil(n / page) - 1``; a partial last
    page is bounded by the tokens it has)."""
    b, h, n, d = keys.shape
    page = bounds.spec.page
    pages = math.ceil(n / page)
    pad = pages * page - n
    lo = torch.cat([keys, keys.new_full((b, h, pad, d), float("inf"))], 2).view(b, h, pages, page, d).amin(3)
    hi = torch.cat([keys, keys.new_full((b, h, pad, d), float("-inf"))], 2).view(b, h, pages, page, d).amax(3)
    bounds.kmin[:, :, :pages].copy_(lo)
    bounds.kmax[:, :, :pages].copy_(hi)


def fold_bounds(bounds: PageBounds, keys: torch.Tensor, start: int) -> None:
    """Fold ``[B, H, n, D]`` keys at positions ``start ..`` into the bounds: each page they touch takes the
    min/max of its bounds so far and theirs (a page never written holds ``+-inf``), so the stored keys
    are never read again (they may be codes)."""
    b, h, n, d = keys.shape
    page = bounds.spec.page
    first, lead = divmod(start, page)
    pages = math.ceil((lead + n) / page)
    tail = pages * page - lead - n
    lo, hi = (torch.cat([keys.new_full((b, h, lead, d), fill), keys, keys.new_full((b, h, tail, d), fill)], 2)
              .view(b, h, pages, page, d) for fill in (float("inf"), float("-inf")))
    kmin, kmax = bounds.kmin[:, :, first:first + pages], bounds.kmax[:, :, first:first + pages]
    torch.minimum(kmin, lo.amin(3), out=kmin)
    torch.maximum(kmax, hi.amax(3), out=kmax)


def uses_triton(backend: str, tensor: torch.Tensor) -> bool:
    """Whether a selection ``backend`` runs the Triton kernels for ``tensor`` (``auto``: on CUDA)."""
    if backend not in SELECT_BACKENDS:
        raise FormatError(f"backend must be one of {', '.join(SELECT_BACKENDS)}, not {backend!r}")
    return backend == "triton" or (backend == "auto" and tensor.is_cuda)


def append_bounds(bounds: PageBounds, key: torch.Tensor, position: torch.Tensor, backend: str = "auto") -> None:
    """Fold one token's key ``[B, H, 1, D]`` at ``position`` (``[1]`` int64 on the device) into its
    page's bounds; the first token of a page replaces them (fixed-shape, graph-capturable). ``backend``
    ``triton`` (or ``auto`` on CUDA): one kernel, :mod:`kvlab.kernels.quest_bounds`."""
    if uses_triton(backend, key):
        if key.stride(-1) != 1 or bounds.kmin.stride(-1) != 1 or bounds.kmax.stride(-1) != 1:
            raise FormatError("the bounds append kernel needs a unit-stride head dim in the key and the bounds")
        from kvlab.kernels.quest_bounds import launch_bounds_append  # imports triton

        launch_bounds_append(bounds.kmin, bounds.kmax, key, position, bounds.spec.page)
        return
    page = position // bounds.spec.page
    fresh = (position % bounds.spec.page == 0).view(1, 1, 1, 1)
    key = key.to(bounds.kmin.dtype)
    lo = torch.where(fresh, key, torch.minimum(bounds.kmin.index_select(2, page), key))
    hi = torch.where(fresh, key, torch.maximum(bounds.kmax.index_select(2, page), key))
    bounds.kmin.index_copy_(2, page, lo)
    bounds.kmax.index_copy_(2, page, hi)


def page_scores(q: torch.Tensor, bounds: PageBounds) -> torch.Tensor:
    """Per query head and page, the bound ``sum_d max(q_d min_d, q_d max_d)``: float32 ``[B, Hq, pages]``
    for ``q [B, Hq, D]`` (one query per row), ``[B, Hq, n, pages]`` for ``q [B, Hq, n, D]`` (a chunk).

    As two products, ``relu(q) . max + min(q, 0) . min`` (Quest's sign trick), so no
    ``[B, Hq, pages, D]`` intermediate is made. Pages never written hold ``+-inf`` bounds and score
    NaN or ``+-inf``; :func:`select_pages` masks pages past the length."""
    chunk = q.dim() == 4
    q4 = q if chunk else q.unsqueeze(2)
    batch, q_heads, n, d = q4.shape
    kv_heads = bounds.kmin.shape[1]
    qf = q4.float().view(batch, kv_heads, q_heads // kv_heads, n, d)
    upper = torch.einsum("bhgnd,bhpd->bhgnp", qf.clamp_min(0), bounds.kmax.float())
    lower = torch.einsum("bhgnd,bhpd->bhgnp", qf.clamp_max(0), bounds.kmin.float())
    scores = (upper + lower).view(batch, q_heads, n, -1)
    return scores if chunk else scores.squeeze(2)


def select_pages(q: torch.Tensor, bounds: PageBounds, lengths: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Pages to read: int64 ``[B, Hsel, k]`` (``Hsel`` = KV heads, or query heads for ``"head"``),
    ``k = spec.selected(capacity)``; the first and the latest page of each row, then the top bounds;
    ``-1`` where a row has fewer pages than ``k``. Fixed shapes, no host sync.

    A chunk of queries ``q [B, Hq, n, D]`` with ``lengths [B, n]`` (each query's own length: the
    tokens visible to it, itself included) gives ``[B, Hsel, n, k]``: each query its own pages, as
    it would select them decoded alone (pages before its latest are whole, so their bounds are final).

    ``backend`` (``triton``: the Triton kernels, interpreted on CPU with ``TRITON_INTERPRET=1``;
    ``auto``: those on CUDA, torch elsewhere; ``reference``: torch) picks how the scores and the top
    pages are found; the kernels read one query per row and ``group_reduce`` max or sum, so the chunk
    and ``"head"`` cases always run torch. The two paths select the same pages (ties aside), in
    different orders: ``topk``'s by score, the kernel's by page."""
    scores = selection_scores(q, bounds, lengths, backend)
    k = bounds.spec.selected(bounds.capacity)
    return top_pages(scores, k, backend if fused_case(q, bounds) else "reference")


def top_pages(scores: torch.Tensor, k: int, backend: str = "reference") -> torch.Tensor:
    """The ``k`` best pages of masked ``scores [..., P]``, ``-1`` where the score is ``-inf``
    (``triton``, or ``auto`` on CUDA: :func:`kvlab.kernels.quest_select.launch_select_top`)."""
    if uses_triton(backend, scores):
        from kvlab.kernels.quest_select import launch_select_top  # imports triton

        return launch_select_top(scores.contiguous(), k)
    top, index = scores.topk(k, dim=-1)
    return torch.where(top == float("-inf"), torch.full_like(index, -1), index)


def fused_case(q: torch.Tensor, bounds: PageBounds) -> bool:
    """Whether the selection kernels read this case: one query per row, one page set per KV head."""
    return q.dim() == 3 and bounds.spec.group_reduce != "head"


def selection_scores(q: torch.Tensor, bounds: PageBounds, lengths: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """What :func:`select_pages` ranks: float32 ``[B, Hsel, P]`` (``[B, Hsel, n, P]`` for a chunk), the
    group-reduced bounds with page 0 and each row's latest page ``+inf`` and pages past it ``-inf``."""
    if uses_triton(backend, q) and fused_case(q, bounds):
        return fused_scores(q, bounds, lengths)
    return reference_scores(q, bounds, lengths)


def fused_scores(q: torch.Tensor, bounds: PageBounds, lengths: torch.Tensor) -> torch.Tensor:
    """:func:`reference_scores` of one query per row in one Triton kernel (:mod:`kvlab.kernels.quest_select`)."""
    batch, q_heads, head_dim = q.shape
    kv_heads = bounds.kmin.shape[1]
    if bounds.spec.group_reduce == "head" or q_heads % kv_heads or bounds.kmin.shape[::3] != (batch, head_dim):
        raise FormatError(f"the fused page scoring reads q [B, Hq, D] against bounds [B, Hkv, P, D] with "
                          f"group_reduce max or sum; got q {list(q.shape)}, bounds {list(bounds.kmin.shape)}, "
                          f"{bounds.spec.group_reduce!r}")
    if q.stride(-1) != 1 or bounds.kmin.stride(-1) != 1 or bounds.kmax.stride(-1) != 1:
        raise FormatError("the fused page scoring needs a unit-stride head dim in q and the bounds")
    from kvlab.kernels.quest_select import launch_quest_select  # imports triton

    return launch_quest_select(q, bounds.kmin, bounds.kmax, lengths.reshape(batch), bounds.spec.page,
                               bounds.spec.group_reduce == "sum")


def reference_scores(q: torch.Tensor, bounds: PageBounds, lengths: torch.Tensor) -> torch.Tensor:
    """:func:`selection_scores` in torch (any ``group_reduce``, a chunk or one query per row)."""
    spec = bounds.spec
    scores = page_scores(q, bounds)  # [B, Hq, P] or [B, Hq, n, P]
    chunk = q.dim() == 4
    if not chunk:
        scores, lengths = scores.unsqueeze(2), lengths.reshape(-1, 1)
    batch, q_heads, n, n_pages = scores.shape
    kv_heads = bounds.kmin.shape[1]
    if spec.group_reduce != "head":
        grouped = scores.view(batch, kv_heads, q_heads // kv_heads, n, n_pages)
        scores = grouped.amax(2) if spec.group_reduce == "max" else grouped.sum(2)
    last = ((lengths.to(torch.int64) - 1).clamp_min(0) // spec.page).view(batch, 1, n, 1)  # the latest page
    pages = torch.arange(n_pages, device=q.device).view(1, 1, 1, n_pages)
    scores = torch.where((pages == 0) | (pages == last), torch.full_like(scores, float("inf")), scores)
    scores = torch.where(pages > last, torch.full_like(scores, float("-inf")), scores)
    return scores if chunk else scores.squeeze(2)



def page_tokens(pages: torch.Tensor, lengths: torch.Tensor, page: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The token slots of the selected ``pages`` (``[B, Hsel, k]``, ``-1`` skipped): int64 ``[B, Hsel, k * page]``
    (clamped into the ``capacity``) and whether each is read (its page selected, before ``lengths[b]``)."""
    batch = pages.shape[0]
    tokens = (pages.clamp_min(0).unsqueeze(-1) * page + torch.arange(page, device=pages.device)).flatten(-2)
    valid = (pages >= 0).repeat_interleave(page, -1) & (tokens < lengths.view(batch, 1, 1).to(tokens.device))
    return tokens.clamp(max=capacity - 1), valid


def selection_heads(q_heads: int, kv_heads: int, sel_heads: int, device) -> torch.Tensor:
    """The KV head each selection reads (one per KV head, or one per query head for ``"head"``)."""
    return torch.arange(sel_heads, device=device) * kv_heads // sel_heads


def attend_tokens(q: torch.Tensor, sk: torch.Tensor, sv: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of ``q [B, Hq, D]`` over gathered ``sk``/``sv [B, Hsel, n, D]`` where ``valid [B, Hsel, n]``;
    float32 ``[B, Hq, D]``."""
    batch, q_heads, d = q.shape
    sel_heads = sk.shape[1]
    qf = q.float().view(batch, sel_heads, q_heads // sel_heads, d)
    logits = torch.einsum("bhgd,bhtd->bhgt", qf, sk.float()) * scale
    logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhgt,bhtd->bhgd", probs, sv.float()).reshape(batch, q_heads, d)


def sparse_attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pages: torch.Tensor,
                  lengths: torch.Tensor, scale: float, page: int) -> torch.Tensor:
    """Attention of ``q [B, Hq, D]`` over the tokens of the selected ``pages`` (``[B, Hsel, k]``, ``-1``
    skipped) of ``keys``/``values [B, H, T, D]``, tokens past ``lengths[b]`` masked; float32 ``[B, Hq, D]``."""
    d = q.shape[-1]
    tokens, valid = page_tokens(pages, lengths, page, keys.shape[2])
    kv_of_sel = selection_heads(q.shape[1], keys.shape[1], pages.shape[1], q.device)
    idx = tokens.unsqueeze(-1).expand(-1, -1, -1, d)
    sk = keys.float()[:, kv_of_sel].gather(2, idx)  # [B, Hs, k*P, D]
    sv = values.float()[:, kv_of_sel].gather(2, idx)
    return attend_tokens(q, sk, sv, valid, scale)


def gather_slots(t: torch.Tensor, heads: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``t [B, H, T, ...]`` at KV heads ``heads`` and token slots ``tokens [B, Hsel, n]``: ``[B, Hsel, n, ...]``
    (one-byte floats gathered as bytes: CPU torch has no float8 gather)."""
    raw = t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t
    idx = tokens.view(*tokens.shape, *(1,) * (t.dim() - 3)).expand(*tokens.shape, *t.shape[3:])
    out = raw[:, heads].gather(2, idx)
    return out.view(t.dtype) if raw is not t else out


def sparse_attend_codes(q: torch.Tensor, keys, values, pages: torch.Tensor, lengths: torch.Tensor, scale: float,
                        page: int) -> torch.Tensor:
    """:func:`sparse_attend` over K/V kept as kvlab format stores (``kvlab.kernels.KVStore``): only the
    selected pages' codes and scales are gathered and dequantized (each token's codes dequantize on
    their own, so this equals dequantizing the whole store, then :func:`sparse_attend`)."""
    tokens, valid = page_tokens(pages, lengths, page, keys.capacity)
    heads = selection_heads(q.shape[1], keys.codes.shape[1], pages.shape[1], q.device)

    def gathered(store):
        parts = (None if t is None else gather_slots(t, heads, tokens) for t in (store.codes, store.scale, store.zero))
        return KVStore(store.format, *parts, store.head_dim).dequantize()

    return attend_tokens(q, gathered(keys), gathered(values), valid, scale)


def quest_attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bounds: PageBounds,
                 lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """One Quest decode step in torch (the ``hf`` engine's path): select from the bounds, attend over
    the selected pages. The fast engine's store runs the kernels instead."""
    pages = select_pages(q, bounds, lengths, "reference")
    return sparse_attend(q, keys, values, pages, lengths, scale, bounds.spec.page)


def chunk_attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bounds: PageBounds,
                 scale: float) -> torch.Tensor:
    """A chunk of ``n`` queries ``q [B, Hq, n, D]``, the last ``n`` of the ``T`` tokens of
    ``keys``/``values [B, H, T, D]`` (``bounds`` cover all ``T``), each read as the decode step of its
    own token would read it: its own pages selected from the tokens up to itself, attention over
    those tokens up to itself (causal). Float32 ``[B, Hq, n, D]``.

    Why: teacher forcing feeds a gold answer or a continuation as one chunk; read densely, its
    logits would not be what decoding those tokens one by one gives (Quest's KL would read ~0).
    Dense logits with a per-row token mask (``O(n T)``, the reference path; the CUDA kernel reads one
    query per row)."""
    batch, q_heads, n, d = q.shape
    kv_heads, total = keys.shape[1], keys.shape[2]
    page = bounds.spec.page
    lengths = (total - n + 1 + torch.arange(n, device=q.device)).expand(batch, n)  # row i sees T - n + i + 1 tokens
    pages = select_pages(q, bounds, lengths)  # [B, Hsel, n, k]
    sel_heads = pages.shape[1]
    chosen = torch.zeros(*pages.shape[:3], bounds.kmin.shape[2] + 1, dtype=torch.bool, device=q.device)
    chosen.scatter_(-1, torch.where(pages < 0, chosen.shape[-1] - 1, pages), True)  # -1 -> a spare column
    visible = chosen[..., :-1].repeat_interleave(page, -1)[..., :total]  # [B, Hsel, n, T]
    causal = torch.arange(total, device=q.device).view(1, 1, 1, total) < lengths.view(batch, 1, n, 1)
    visible = visible & causal
    kv_of_sel = torch.arange(sel_heads, device=q.device) * kv_heads // sel_heads
    per_sel = q_heads // sel_heads
    qf = q.float().view(batch, sel_heads, per_sel, n, d)
    logits = torch.einsum("bhgnd,bhtd->bhgnt", qf, keys.float()[:, kv_of_sel]) * scale
    logits = logits.masked_fill(~visible.unsqueeze(2), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    out = torch.einsum("bhgnt,bhtd->bhgnd", probs, values.float()[:, kv_of_sel])
    return out.reshape(batch, q_heads, n, d)
