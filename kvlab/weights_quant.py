"""Weight quantization stacked under a cache policy (optimum-quanto int8 / int4 weights).

Why: practitioners stack a quantized model on a quantized cache, and the two dequantize costs add up
at every decode step (a threefold decode slowdown has been reported); a sweep axis ``weights_quant``
measures the stack instead of assuming it. The weights are quantized once after the model loads
(``quantize`` then ``freeze``: the int codes replace the float weights). ``lm_head`` stays in the
model dtype, as usual for weight-only quantization (it decides every token). Only transformers'
decode loop (engine ``hf``) takes quanto's ``QLinear`` modules: the fast engine fuses q/k/v and
gate/up ``nn.Linear`` weights into views of one tensor, which quantized weights cannot be.
"""

from __future__ import annotations

from typing import Any

WEIGHTS_QUANT = ("none", "int8", "int4")
KEEP_IN_MODEL_DTYPE = ("lm_head",)


def weights_label(label: str, scheme: str) -> str:
    """A method's label with its weight quantization, so every report groups the stack apart
    (``full`` stays ``full`` with float weights)."""
    return label if scheme in (None, "none") else f"{label} · w-{scheme}"


def weights_quant_problems(schemes: list[str], engines: list[str]) -> list[str]:
    """Why a sweep cannot stack these weight quantizations (one line each), before any model loads."""
    stacked = [s for s in schemes if s != "none"]
    if not stacked:
        return []
    problems = []
    if "fast" in engines:
        problems.append(f"weights_quant: {', '.join(stacked)} with engine: fast: the fast engine fuses q/k/v and "
                        f"gate/up weights into one GEMM, which quanto's quantized weights cannot join; use "
                        f"engine: [hf] for the stacked runs (a second sweep can run fast with weights_quant: none)")
    import importlib.util

    if importlib.util.find_spec("optimum.quanto") is None:
        problems.append("weights_quant: needs the optimum-quanto package; pip install optimum-quanto")
    return problems


def quantize_weights(model: Any, scheme: str) -> Any:
    """Quantize ``model``'s linear weights in place (int8 or int4, quanto) and freeze them; ``none``
    leaves the model as it is. Returns the model."""
    if scheme in (None, "none"):
        return model
    if scheme not in WEIGHTS_QUANT:
        raise ValueError(f"weights_quant {scheme!r} is not one of {', '.join(WEIGHTS_QUANT)}")
    from optimum.quanto import freeze, qint4, qint8, quantize

    quantize(model, weights={"int8": qint8, "int4": qint4}[scheme], exclude=list(KEEP_IN_MODEL_DTYPE))
    freeze(model)
    return model


def quantized_linears(model: Any) -> int:
    """How many linear layers of ``model`` hold quanto-quantized weights (records and tests)."""
    from optimum.quanto import QModuleMixin

    return sum(1 for m in model.modules() if isinstance(m, QModuleMixin) and m.weight_qtype is not None)
