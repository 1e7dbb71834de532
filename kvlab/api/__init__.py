"""`kvlab serve`: an OpenAI-compatible HTTP server over the serving engine (:mod:`kvlab.serve`).

One module per job: ``protocol`` (request bodies in, response bodies out, the API's error object:
pure functions), ``bridge`` (the engine's loop in one background thread, token events handed to
per-request asyncio queues), ``prometheus`` (the ``/metrics`` text), ``server`` (the aiohttp app:
routes, streaming, disconnects).
"""
