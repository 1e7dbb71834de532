"""Serving under traffic: continuous batching over paged KV blocks, request traces, per-request
records and the serving metrics (TTFT, TPOT, ITL, E2E, goodput) computed from them."""

SERVED = ("full", "snapkv", "kvq-fp8", "kvq-int4", "kvq-int2", "quest", "kivi")  # the methods the serving engine runs


def block_size_problem(storage, block_size: int) -> str | None:
    """Why a method's ``storage`` cannot be served in pool blocks of ``block_size`` tokens (None: it can).
    A Quest page is one block (its bounds sit beside the pool, one min and max per block); a KIVI key
    group is one block (its per-channel scales, one per block)."""
    for name, what in (("page", "quest pages"), ("q_group_size", "kivi key groups")):
        tokens = getattr(storage, name, block_size)
        if tokens != block_size:
            return (f"{what} of {tokens} tokens are stored in pool blocks of {block_size}: serve it with "
                    f"block_size={tokens} (one block each), or {name}={block_size}")
    return None
