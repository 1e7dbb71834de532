"""How the KV cache is stored and read, one module per family, each holding its halves for the hf, fast and
serving engines.

    storage = policy.storage()                  # a kvlab.storage.base.Storage
    storage.make_cache(num_layers)              # hf: a transformers cache of the family's layers
    store = storage.store(layout, options)      # fast: static buffers the captured step attends
    storage.token_bytes(kv_heads, head_dim)     # bytes per token; storage.paged(...): blocks
    pool = storage.paged_pool(shape, dtype, device)   # serving: the family's block pool (kvlab.serve)

Families: :mod:`~kvlab.storage.dense` (the model dtype), :mod:`~kvlab.storage.kvq` (kvlab's fp8,
int4, int2 formats), :mod:`~kvlab.storage.kivi` (KIVI-style keys per channel, values per token, a
bf16 ring), :mod:`~kvlab.storage.quest` (page bounds beside a dense store, a sparse read),
:mod:`~kvlab.storage.ragged` (per-KV-head budgets). Shared: :mod:`~kvlab.storage.base` (the
protocol, stats, budget math), :mod:`~kvlab.storage.slots` (the stores' slots and attention
wrappers), :mod:`~kvlab.storage.store_cache` and :mod:`~kvlab.storage.loading` (prefill into a
store), :mod:`~kvlab.storage.paged` (the serving pools' protocol), :mod:`~kvlab.storage.attention` (the
query hand-off to cache layers). Kernels live in
:mod:`kvlab.kernels`; eviction, composed over a family's cache layer, in :mod:`kvlab.policies`.
"""
