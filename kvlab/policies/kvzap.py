"""KVzap: KVzip's scores predicted from each layer's attention input by a small learned surrogate, so a
prefill scores its positions with one matrix product per layer instead of KVzip's reconstruction
forwards (kvpress ``KVzapPress`` at 0.5.5, arXiv 2601.07891).

Rule: layer ``l``'s score of position ``t`` for KV head ``h`` is ``W[l, h] . x_t + b[l, h]``, where
``x_t`` is the attention module's input at ``t`` (the decoder layer's hidden state after its
``input_layernorm``: kvpress's ``hidden_states`` keyword of ``self_attn``); each layer keeps its
``floor(n x keep)`` top positions per KV head (kvpress's ``ScorerPress`` top-k), the first ``n_sink``
and last ``window`` positions scored above everything (``n_sink=0, window=0`` is kvpress's bare
``KVzapPress``; KVzip's targets score its sinks above everything, so the surrogate is trained without
them and never learns to keep them). kvpress also prunes by
a score threshold (``DMSPress(KVzapPress(), threshold)``, a content-dependent number per head, masked
rather than freed); kvlab prunes by ``keep`` only. kvpress ships a linear and a 2-layer MLP surrogate;
kvlab reads linear ones (``W`` ``[L, Hkv, hidden]``, ``b`` ``[L, Hkv]``).

The surrogate: ``surrogate='auto'`` is the one packaged for the model's shape (``kvlab/data/kvzap/``,
trained by ``scripts/train_kvzap.py`` on kvlab's own KVzip scores: SmolLM2-135M today); a path reads
a safetensors file of that layout; ``'random'`` is a seeded random one of the model's shape, for cost
runs on synthetic weights (its selections mean nothing).

Where the hidden states come from: a forward pre-hook on every attention module offers its input to
the cache layer of the same index (a per-thread slot, taken back by a forward hook after the module
ran); the evicting layer scores the new rows in its prefill ``update``, which runs inside that
module's forward. Scores depend on one token's hidden state alone, so a chunked prefill keeps each
position's score from when it arrived and its selection is the one-shot selection (up to ties).

Cost: ``n x hidden x Hkv`` multiply-adds per layer at the prefill (SmolLM2: 576 x 3 per token and
layer, about 0.2% of its q, k, v and o projections), and one float32 ``[B, Hkv, n]`` score tensor per
layer while the prompt streams in.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from functools import cache as memoize
from pathlib import Path

import torch

from kvlab.policies.base import PolicyError, hf_model, int_param, model_shape
from kvlab.policies.cache import EvictionError
from kvlab.policies.eviction import EvictionPolicy
from kvlab.policies.mixed import mixed_cache

SURROGATES = Path(__file__).resolve().parents[1] / "data" / "kvzap"
RANDOM_SEED = 0
_slots = threading.local()


# -- the surrogate ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Surrogate:
    """A linear surrogate per layer: ``weight`` ``[L, Hkv, hidden]``, ``bias`` ``[L, Hkv]`` (float32)."""

    weight: torch.Tensor
    bias: torch.Tensor
    source: str

    def scores(self, hidden: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """``hidden`` ``[B, n, hidden]`` -> ``[B, Hkv, n]`` float32 (kvpress's ``Linear`` on the hidden states)."""
        w = self.weight[layer_idx].to(hidden.device)
        b = self.bias[layer_idx].to(hidden.device)
        return torch.nn.functional.linear(hidden.float(), w, b).transpose(1, 2)

    def problem(self, num_layers: int, kv_heads: int, hidden_size: int) -> str | None:
        want = (num_layers, kv_heads, hidden_size)
        if tuple(self.weight.shape) != want or tuple(self.bias.shape) != want[:2]:
            return (f"the KVzap surrogate {self.source} is for (layers, KV heads, hidden) = "
                    f"{tuple(self.weight.shape)}, the model has {want}")
        return None


def save_surrogate(path: Path, weight: torch.Tensor, bias: torch.Tensor, metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    save_file({"weight": weight.float().contiguous(), "bias": bias.float().contiguous()}, str(path), metadata=metadata)


@memoize
def read_surrogate(path: str) -> Surrogate:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(path)
    except (OSError, SafetensorError) as err:
        raise PolicyError(f"cannot read the KVzap surrogate {path}: {err}; pass a safetensors file written by "
                          f"scripts/train_kvzap.py") from err
    if set(tensors) != {"weight", "bias"} or tensors["weight"].dim() != 3 or tensors["bias"].dim() != 2:
        raise PolicyError(f"{path} is not a linear KVzap surrogate (tensors 'weight' [L, Hkv, hidden] and "
                          f"'bias' [L, Hkv]); got {sorted(tensors)}")
    return Surrogate(tensors["weight"].float(), tensors["bias"].float(), path)


def random_surrogate(num_layers: int, kv_heads: int, hidden_size: int) -> Surrogate:
    gen = torch.Generator().manual_seed(RANDOM_SEED)
    weight = torch.randn(num_layers, kv_heads, hidden_size, generator=gen) / hidden_size ** 0.5
    return Surrogate(weight, torch.zeros(num_layers, kv_heads), "random")


def packaged(num_layers: int, kv_heads: int, hidden_size: int) -> Path | None:
    """The packaged surrogate file for this shape (its name says it), or None."""
    path = SURROGATES / f"linear-L{num_layers}-H{kv_heads}-D{hidden_size}.safetensors"
    return path if path.exists() else None


# -- the hidden states' hand-off ----------------------------------------------------------------------
def _slot_map() -> dict:
    slots = getattr(_slots, "map", None)
    if slots is None:
        slots = _slots.map = {}
    return slots


def take_hidden(layer_idx: int) -> torch.Tensor | None:
    """The input of the attention module of ``layer_idx`` now running (None outside its forward)."""
    return _slot_map().get(layer_idx)


def _offer(module, args, kwargs):
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    _slot_map()[module.layer_idx] = hidden


def _withdraw(module, args, kwargs, output):
    _slot_map().pop(module.layer_idx, None)


def install_hidden_states(model) -> None:
    """Pre- and post-hooks on every attention module (``*.self_attn`` with a ``layer_idx``) that offer
    its input to the cache layer while it runs (idempotent, inert for other caches)."""
    for name, module in hf_model(model).named_modules():
        if name.endswith("self_attn") and hasattr(module, "layer_idx") and not getattr(module, "_kvlab_kvzap", False):
            module.register_forward_pre_hook(_offer, with_kwargs=True)
            module.register_forward_hook(_withdraw, with_kwargs=True)
            module._kvlab_kvzap = True


class HiddenScoresMixin:
    """An evicting layer that scores each prompt row by the surrogate when it arrives; the eviction
    reads those scores at the rows it holds."""

    surrogate: Surrogate

    def _clear_eviction(self) -> None:
        super()._clear_eviction()
        self.position_scores: torch.Tensor | None = None  # [B, Hkv, prompt so far], freed once it is in

    def _prefill(self, new_keys, new_values):
        hidden = take_hidden(self.layer_idx)
        if hidden is None or hidden.shape[1] != new_keys.shape[-2]:
            raise EvictionError(f"kvzap: layer {self.layer_idx} got no attention input for its prefill: "
                                f"call policy.prepare(model) before the first forward")
        new = self.surrogate.scores(hidden, self.layer_idx)
        self.position_scores = new if self.position_scores is None else torch.cat([self.position_scores, new], -1)
        out = super()._prefill(new_keys, new_values)
        if not self._streaming:
            self.position_scores = None
        return out

    def _evict(self, keys, values, n_kept, attn, positions=None) -> None:
        scores = self.position_scores
        if positions is None:
            where = torch.arange(keys.shape[-2], device=scores.device)
        else:
            where = positions.long().to(scores.device)
            scores = scores.gather(-1, where)
        total = self._stream_length or self.prompt_length
        protected = (where < self.policy.n_sink) | (where >= total - self.policy.window)
        scores = torch.where(protected, torch.full_like(scores, float("inf")), scores)
        super()._evict(keys, values, n_kept, scores, positions)


# -- the policy ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KVzapPolicy(EvictionPolicy):
    name = "kvzap"
    summary = "KVzip's scores predicted from each layer's attention input by a linear surrogate (one matmul)"

    n_sink: int = int_param(4, "first positions always kept (KVzip's sinks, which the surrogate is not trained on; "
                               "0: kvpress's bare KVzapPress)", minimum=0)
    window: int = int_param(0, "last prompt positions always kept (kvpress's DMSPress sliding window, 128 there)",
                            minimum=0)
    surrogate: str = field(default="auto", metadata={
        "help": "'auto' (the packaged surrogate for the model: SmolLM2-135M), a safetensors path written by "
                "scripts/train_kvzap.py, or 'random' (seeded, for cost runs on synthetic weights)"})

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.surrogate, str) or not self.surrogate:
            raise PolicyError(f"surrogate must be 'auto', 'random' or a path to a safetensors file, got "
                              f"{self.surrogate!r}")
        if self.surrogate not in ("auto", "random") and not Path(self.surrogate).is_file():
            raise PolicyError(f"surrogate {self.surrogate!r} is not a file: pass 'auto', 'random' or the path of "
                              f"a surrogate written by scripts/train_kvzap.py")

    @property
    def label(self) -> str:
        text = f"{self.name} {self.keep:.0%}"
        text += "" if self.n_sink == 4 else f" sinks {self.n_sink}"
        text += f" window {self.window}" if self.window else ""
        return self.chunk_label(f"{text} + {self.quant.label}" if self.quant else text)

    def score(self, keys, values, attn, layer_idx):
        return attn  # the surrogate's scores at the rows held, [B, Hkv, n]

    def load_surrogate(self, model) -> Surrogate:
        """The surrogate for ``model`` (a model, ``LoadedModel``, spec or config), its shape checked."""
        spec = model_shape(model).spec
        shape = (spec.num_layers, spec.num_kv_heads, spec.hidden_size)
        if self.surrogate == "random":
            return random_surrogate(*shape)
        path = packaged(*shape) if self.surrogate == "auto" else Path(self.surrogate)
        if path is None:
            raise PolicyError(f"no KVzap surrogate is packaged for {spec.name} (layers, KV heads, hidden = {shape}): "
                              f"train one with scripts/train_kvzap.py and pass surrogate=PATH, or "
                              f"surrogate='random' to measure cost alone")
        found = read_surrogate(str(path.resolve()))
        problem = found.problem(*shape)
        if problem:
            raise PolicyError(problem)
        return found

    def check(self, model) -> None:
        super().check(model)
        self.load_surrogate(model)

    def prepare(self, model) -> None:
        super().prepare(model)
        install_hidden_states(model)

    def layer_mixins(self) -> tuple[type, ...]:
        return (HiddenScoresMixin,)

    def make_cache(self, model):
        cache = mixed_cache(self, model, self.layer_mixins())
        surrogate = self.load_surrogate(model)
        for layer in cache.layers:
            layer.surrogate = surrogate
        return cache
