"""What goes into the serving engine and what comes out of it (re-exported by ``kvlab.serve.engine``)."""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.errors import UserError


class ServeError(UserError):
    """A serving request or configuration that can never run (too long for the pool, bad method)."""


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    arrival_s: float  # on the engine's clock (time.perf_counter based)
    ignore_eos: bool = True


@dataclass
class TokenEvent:
    request_id: str
    token_id: int
    time_s: float
    finished: bool
    finish_reason: str | None  # "length" | "stop" | "abort" | None
