"""`kvlab generate`'s work: policy from the flags, checks before the load, the generation, its JSON."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvlab import models
from kvlab.budget import context_problem
from kvlab.columns import model_columns, policy_columns
from kvlab.engine import check_model_type
from kvlab.engine.engines import generate_text, make_engine
from kvlab.errors import UserError
from kvlab.policies import POLICIES, PolicyError, QuantizedPolicy, make_policy
from kvlab.policies.eviction import EvictionPolicy
from kvlab.policies.quantized import BACKENDS, DEFAULT_BACKEND
from kvlab.preflight import (
    compressions,
    device_problem,
    outlier_keys_warnings,
    print_warnings,
    read_text_file,
    require,
    shape_problems,
    weights_problem,
)
from kvlab.sweep.params import DTYPES
from kvlab.yamlfile import load_yaml

EVICTION_FLAGS = {"keep": "keep", "window_size": "window_size", "kernel_size": "kernel_size",
                  "n_sink": "n_sink", "beta": "beta", "policy_seed": "seed"}
QUANT_FLAGS = {"bits": "nbits", "group_size": "q_group_size", "residual": "residual_length",
               "axis_key": "axis_key", "axis_value": "axis_value", "key_offset": "key_offset"}
DECODING_FLAGS = {"target": "target", "interval": "interval", "score": "score"}
READ_FLAGS = {"key_bits": "key_bits", "value_group": "value_group", "page": "page", "token_budget": "budget",
              "group_reduce": "group_reduce", "dense_layers": "dense_layers"}  # storages' own knobs
ADAKV_FLAGS = {"scorer": "scorer", "alpha_safeguard": "alpha_safeguard", "scope": "scope"}



def stores_bits(cls) -> bool:
    """Whether a method takes the quantization flags as its own parameters (a quantized storage's)."""
    return {"nbits", "q_group_size"} <= {row["name"] for row in cls.describe()}


def _given(args, flags: dict[str, str]) -> dict:
    return {param: getattr(args, flag) for flag, param in flags.items() if getattr(args, flag) is not None}


def policy_from_args(args):
    """Map CLI flags to ``make_policy`` parameters; every check happens in ``make_policy``."""
    params = _given(args, EVICTION_FLAGS)
    if getattr(args, "prefill_chunk", None) is not None:
        params["prefill_chunk"] = args.prefill_chunk
    quant = _given(args, QUANT_FLAGS)
    cls = POLICIES.get(args.method)
    if cls is not None and issubclass(cls, EvictionPolicy):
        if quant or args.backend:
            params["quant"] = {"backend": args.backend or DEFAULT_BACKEND, **quant}
    elif cls is not None and (issubclass(cls, QuantizedPolicy) or stores_bits(cls)):
        if args.backend and args.backend != args.method:
            raise PolicyError(f"--backend {args.backend} contradicts --method {args.method}: drop --backend")
        params.update(quant)
    elif cls is not None and (quant or args.backend):  # full, decoding: no quantized storage to give them to
        flags = [f"--{flag.replace('_', '-')}" for flag in (*QUANT_FLAGS, "backend") if getattr(args, flag) is not None]
        raise PolicyError(f"{' '.join(flags)}: --method {args.method} stores the model dtype: for a quantized cache "
                          f"use --method {' / '.join(BACKENDS)} (or an eviction method with --bits to evict then "
                          f"quantize)")
    params.update(_given(args, DECODING_FLAGS))  # make_policy names them if the method takes none
    params.update(_given(args, READ_FLAGS))
    params.update(_given(args, ADAKV_FLAGS))
    for key, value in param_overrides(getattr(args, "param", None) or []).items():
        if key in params:
            raise UserError(f"--param {key}: {key} is already set by its own flag; give it once")
        params[key] = value
    return make_policy(args.method, **params)


def param_overrides(items: list[str]) -> dict:
    """``--param KEY=VALUE`` items as policy parameters (values parsed as YAML: numbers, true/false,
    mappings such as ``scorer_params={epsilon: 0.01}``); ``make_policy`` checks the names and values."""
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise UserError(f"--param {item!r}: write KEY=VALUE, e.g. --param alpha_safeguard=0.1")
        out[key] = load_yaml(raw, f"--param {item!r}: the value", UserError) if raw.strip() else None
    return out


def _prompt_ids(args, tokenizer, vocab_size: int, text: str | None):
    if args.prompt_tokens is not None:
        g = torch.Generator().manual_seed(args.seed)
        return torch.randint(0, vocab_size, (1, args.prompt_tokens), generator=g)
    if args.chat:
        messages = [{"role": "user", "content": text}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    return tokenizer(text, return_tensors="pt").input_ids


def _prompt_text(args) -> str | None:
    """The prompt text (None with --prompt-tokens), read and checked before any model loads."""
    if args.prompt_tokens is not None:
        return None
    if args.prompt_file is None:
        text = args.prompt
        where = "--prompt"
    else:
        path = Path(args.prompt_file)
        where = f"--prompt-file {path}"
        text = read_text_file(path, where, "pass a text file")
    if not text.strip():
        raise UserError(f"{where} is empty: give the prompt text (or --prompt-tokens N for random tokens)")
    return text


def _check_args(args, spec, policy) -> None:
    """Every check that needs no weights: device, dtype, prompt source, lengths, memory."""
    require(device_problem(args.device), weights_problem(args.model, args.weights))
    if args.dtype is not None and args.dtype not in DTYPES:
        raise UserError(f"--dtype {args.dtype!r} is not one of {', '.join(DTYPES)}")
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.prompt_tokens is not None:
        if args.prompt_tokens < 1:
            raise UserError(f"--prompt-tokens must be >= 1, got {args.prompt_tokens}")
        require(*shape_problems(spec, args.device, args.dtype, args.prompt_tokens, 1, args.max_new_tokens,
                                ctx_key="--prompt-tokens", new_key="--max-new-tokens",
                                compressions=compressions([policy])))
    elif args.weights == "synthetic":
        raise UserError("synthetic weights come without a tokenizer: pass --prompt-tokens N instead of text")
    else:
        require(*shape_problems(spec, args.device, args.dtype, 1, 1, args.max_new_tokens,
                                ctx_key="the prompt", new_key="--max-new-tokens", compressions=compressions([policy])))


def generate(args) -> int:
    """``kvlab generate``: checks before the load, then one generation on the engine asked for."""
    policy = policy_from_args(args)
    spec = models.get_spec(args.model)
    policy.check(spec)
    _check_args(args, spec, policy)
    text = _prompt_text(args)
    print_warnings("kvlab generate", outlier_keys_warnings(args.model, args.weights, [policy]))
    if args.engine == "fast":
        check_model_type(spec.model_type)
        policy.storage()  # formats the fast engine cannot store fail here, before the load
    loaded = models.load_model(args.model, weights=args.weights, device=args.device, dtype=args.dtype, seed=args.seed)
    if loaded.tokenizer is None and args.prompt_tokens is None:
        raise UserError(f"{args.model} has no tokenizer here: pass --prompt-tokens N")
    ids = _prompt_ids(args, loaded.tokenizer, loaded.spec.vocab_size, text)
    if ids.shape[1] == 0:
        raise UserError("the prompt tokenizes to no tokens: give some text")
    require(context_problem(spec, int(ids.shape[1]), args.max_new_tokens, key="the prompt",
                            new_key="--max-new-tokens"))
    policy.warmup(loaded.model)
    engine = make_engine(args.engine, loaded)
    result = generate_text(loaded, ids, policy, args.max_new_tokens, engine=engine)

    out = {
        **result.columns,
        **model_columns(loaded),
        **policy_columns(policy, args.engine),
        "prompt_tokens": result.prompt_tokens,
        "new_tokens": int(result.tokens.shape[1]),
        "answer": result.text,
        "token_ids": result.tokens[0].tolist(),
        "cache_after_prefill": result.cache_after_prefill,
        "cache_final": result.cache_final,
    }
    if policy.name != "full" and loaded.weights == "real" and not args.no_fidelity_check:
        from kvlab.quality.reply import reply_kl, reply_verdict

        kl = reply_kl(loaded, policy, ids[0].tolist(), result.tokens[0].tolist())
        out.update(reply_kl=kl, fidelity=reply_verdict(kl))
    print(json.dumps(out) if args.json else format_text(out))
    return 0


def _size(stats: dict) -> str:
    return (f"logical {stats['logical_tokens']} tokens, physical {stats['physical_tokens']} tokens, "
            f"{stats['bytes'] / 1024**2:,.3f} MiB ({stats['bytes']:,} B)")


def format_text(out: dict) -> str:
    answer = out["answer"] if out["answer"] is not None else f"(token ids) {out['token_ids']}"
    return "\n".join([
        f"model   {out['model']} ({out['weights']} weights, {out['device']}, {out['dtype']}), "
        f"attention {out['attn_implementation']}",
        f"policy  {out['label']}   {json.dumps(out['policy_params'])}   engine {out['engine']}",
        f"prompt  {out['prompt_tokens']} tokens -> {out['new_tokens']} new tokens",
        f"answer  {answer}",
        f"cache after prefill  {_size(out['cache_after_prefill'])}",
        f"cache at the end     {_size(out['cache_final'])}",
        *([f"fidelity  {out['fidelity']}"] if "fidelity" in out else []),
    ])
