"""Serving under traffic: continuous batching over paged KV blocks, request traces, per-request
records and the serving metrics (TTFT, TPOT, ITL, E2E, goodput) computed from them. The methods it
serves are the registry's ``SERVED`` (:mod:`kvlab.policies`); each storage family's blocks are its
own pool (:meth:`kvlab.storage.base.Storage.paged_pool`)."""
