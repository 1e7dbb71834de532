"""Serving under traffic: continuous batching over paged KV blocks, request traces, per-request
records and the serving metrics (TTFT, TPOT, ITL, E2E, goodput) computed from them."""

SERVED = ("full", "snapkv", "kvq-fp8", "kvq-int4", "kvq-int2", "quest")  # the methods the serving engine runs


def block_size_problem(storage, block_size: int) -> str | None:
    """Why a method's ``storage`` cannot be served in pool blocks of ``block_size`` tokens (None: it can).
    A Quest page is one block (its bounds sit beside the pool, one min and max per block)."""
    page = getattr(storage, "page", block_size)
    if page == block_size:
        return None
    return (f"quest pages of {page} tokens are read from pool blocks of {block_size}: serve it with "
            f"block_size={page} (a page is one block), or quest page={block_size}")
