"""The policy contract: validated parameters in, a fresh transformers ``Cache`` out.

A policy is a frozen dataclass: its fields are the typed parameters (shown by ``kvlab policies``),
``__post_init__`` validates them, so a bad value fails in ``make_policy`` before a model loads.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar

from kvlab.budget import keep_problem
from kvlab.errors import PolicyError
from kvlab.storage.base import ModelShape, Storage, check_int, hf_model, model_shape, on_cuda
from kvlab.storage.dense import DenseStorage

__all__ = ["ModelShape", "Policy", "PolicyError", "attached", "check_int", "check_keep", "hf_model", "int_param",
           "model_shape", "on_cuda"]


@contextmanager
def attached(policies, model, warm: bool = False) -> Iterator[None]:
    """:meth:`Policy.attach` for several policies at once (undone in reverse order on exit)."""
    with ExitStack() as stack:
        for policy in policies:
            stack.enter_context(policy.attach(model, warm=warm))
        yield


def check_keep(keep: Any) -> float:
    if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not math.isfinite(keep):
        raise PolicyError(f"keep must be a number in (0, 1], got {keep!r}")
    problem = keep_problem(keep)
    if problem:
        raise PolicyError(problem)
    return float(keep)


def int_param(default: int, help_text: str, minimum: int) -> Any:
    """A policy's integer parameter: its default, its help, and the least value :class:`Policy` accepts."""
    return field(default=default, metadata={"help": help_text, "minimum": minimum})


def _json_safe(value: Any) -> Any:
    if hasattr(value, "params"):
        return value.params()
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def check_prefill_chunk(chunk: Any) -> int | None:
    if chunk is None:
        return None
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise PolicyError(f"prefill_chunk must be a whole number of tokens >= 1 (or null for a one-shot "
                          f"prefill), got {chunk!r}")
    return chunk


@dataclass(frozen=True)
class Policy:
    """Base of every cache policy. Subclasses set ``name``/``summary`` and implement ``make_cache``.

    ``prefill_chunk`` (every policy): the prompt goes through the model this many tokens at a time
    (:func:`kvlab.engine.generation.prefill`); an evicting cache compresses as it streams in
    (:mod:`kvlab.policies.chunking`). None: one forward over the whole prompt.
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""

    prefill_chunk: int | None = field(default=None, kw_only=True, metadata={
        "help": "prefill the prompt this many tokens at a time, compressing as it streams in (null: one shot)"})

    def __post_init__(self):
        object.__setattr__(self, "prefill_chunk", check_prefill_chunk(self.prefill_chunk))
        for f in fields(self):
            if "minimum" in f.metadata:
                check_int(f.name, getattr(self, f.name), minimum=f.metadata["minimum"])

    @property
    def keep(self) -> float:
        """Fraction of prompt positions kept (1.0 when the policy does not evict)."""
        return 1.0

    @property
    def bits(self) -> int | None:
        """Stored bits per K/V element, or None for the model dtype."""
        return None

    @property
    def label(self) -> str:
        return self.chunk_label(self.name)

    def engine_label(self, engine: str) -> str:
        """The label of what runs on ``engine``: :attr:`label`, except where the fast engine stores a
        method's K/V in another format than its name says (quanto int4 on fast is kvlab's int4-g64
        store: 'kvq int4-g64 (asked: quanto int4)')."""
        return self.label

    def chunk_label(self, text: str) -> str:
        """``text`` plus the prefill chunk, when there is one (so plots keep chunked runs apart)."""
        return text if self.prefill_chunk is None else f"{text} chunk {self.prefill_chunk}"

    def asked_as(self, ran: str) -> str:
        """``ran`` (the label of what ran), followed by the label asked for when the two differ."""
        return ran if ran == self.label else f"{ran} (asked: {self.label})"

    def chunk_params(self) -> dict[str, Any]:
        """``{"prefill_chunk": n}`` when chunked, else nothing (one-shot runs keep their ids)."""
        return {} if self.prefill_chunk is None else {"prefill_chunk": self.prefill_chunk}

    def params(self) -> dict[str, Any]:
        """Everything that identifies the run, JSON-safe, for records."""
        out: dict[str, Any] = {"method": self.name}
        for f in fields(self):
            if f.name == "prefill_chunk" and self.prefill_chunk is None:
                continue
            out[f.name] = _json_safe(getattr(self, f.name))
        out.setdefault("keep", self.keep)
        out.setdefault("bits", self.bits)
        return out

    @classmethod
    def from_params(cls, **params: Any) -> Policy:
        """A validated policy; raises :class:`PolicyError` (naming the fix) before any heavy work."""
        allowed = [row["name"] for row in cls.describe()]
        unknown = sorted(set(params) - set(allowed))
        if unknown:
            own = [name for name in allowed if name != "prefill_chunk"]  # every policy takes prefill_chunk
            hint = (f"; {cls.name} takes: {', '.join(own)}" if own else f"; {cls.name} takes no parameters") \
                + " (and prefill_chunk, like every method)"
            raise PolicyError(f"unknown parameter(s) {', '.join(unknown)} for {cls.name}{hint}")
        return cls(**params)

    @classmethod
    def describe(cls) -> list[dict[str, Any]]:
        """The typed parameters with defaults and help, for ``kvlab policies``."""
        rows = []
        for f in fields(cls):
            default = f.default if f.default is not MISSING else None
            rows.append({"name": f.name, "type": str(f.type), "default": _json_safe(default),
                         "help": f.metadata.get("help", "")})
        return rows

    def check(self, model) -> None:
        """Raise :class:`PolicyError` if this policy cannot run on ``model`` (cheap, no tensors)."""

    def stores_keys_per_token(self) -> bool:
        """Whether each token's keys are quantized with one range and no key offset (a model with
        outlier key channels breaks that; the preflight warns)."""
        return False

    def shape_problem(self, ctx: int) -> str | None:
        """Why this policy would fail, or silently become another method, on a ``ctx``-token prompt
        (a plan's shortest is asked before any load); None when it runs as written."""
        return None

    def prepare(self, model) -> None:
        """Install what the policy needs on the model (idempotent)."""

    def warmup(self, model) -> None:
        """One-off costs (kernel builds) to pay outside any timed region."""

    def make_cache(self, model):
        """A fresh transformers ``Cache`` for one generation."""
        raise NotImplementedError

    @contextmanager
    def attach(self, model, warm: bool = True) -> Iterator[Policy]:
        """The one lifecycle of a policy on a model: check, prepare, warm up (unless ``warm`` is
        False), yield the policy, and on exit give the model back the attention implementation it
        had (``prepare`` may switch it to kvlab's query hand-off)::

            with policy.attach(loaded) as bound:
                cache = bound.make_cache(loaded.model)
        """
        self.check(model)
        inner = hf_model(model)
        config = getattr(inner, "config", None)
        before = getattr(config, "_attn_implementation", None)
        try:
            self.prepare(inner)
            if warm:
                self.warmup(inner)
            yield self
        finally:
            if config is not None and before is not None and config._attn_implementation != before:
                inner.set_attn_implementation(before)

    # -- the fast engine (kvlab.engine.fast) -----------------------------------------------------
    def kept_tokens(self, n: int, num_layers: int) -> list[int]:
        """Prompt tokens each layer keeps after a prefill of ``n`` (sizes the fast engine's buffers)."""
        return [n] * num_layers

    def storage(self) -> Storage:
        """How both engines keep this policy's K/V (:mod:`kvlab.storage`): by default the whole cache
        at the model dtype, the prompt written straight into the fast engine's store."""
        return DenseStorage()
