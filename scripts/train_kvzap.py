"""Train KVzap's linear surrogate on SmolLM2 (CPU, a few minutes): kvlab's own KVzip scores as targets.

    python scripts/train_kvzap.py --out kvlab/data/kvzap --log reports/cpu-kvzap-2026-12-07/train_log.json

Data (kvpress ``kvzap/data.py`` and ``train.py`` at 0.5.5, with kvlab's pieces): windows of ``--tokens``
tokens of the text kvlab's quality tasks read (the pydoc topic pages that ship with Python,
:func:`kvlab.quality.continuation.stdlib_text`); train windows from the first ``1 - --test-fraction`` of
its tokens, test windows from the rest. Each window is prefilled through kvlab's ``kvzip`` cache; ``X``
is each layer's attention input at the prefill (after ``input_layernorm``: what ``KVzapPress`` reads),
``y`` the log of that layer's KVzip score per KV head (kvpress trains on log KVzip+ scores, which also
divide by ``||h||`` and weigh by ``||W_o v||``: here the plain KVzip score kvlab evicts by). The first
``n_sink`` positions (scored above everything by KVzip's sink rule) are left out.

Fit: per layer, ridge regression with an intercept (sklearn ``Ridge()`` as kvpress calls it: alpha 1,
the intercept unpenalised) in closed form on ``--per-window`` random positions of each train window.
Held-out on every position of the test windows: R^2 per layer, Spearman rank correlation per layer and
head, and the Jaccard of the top ``floor(n keep)`` positions per head against KVzip's own.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def windows(n_ids: int, tokens: int, count: int, lo: int, hi: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return sorted(int(v) for v in torch.randint(lo, hi - tokens, (count,), generator=gen))


def collect(model, ids: torch.Tensor, n_sink: int):
    """(hidden ``[L, n, D]``, log KVzip scores ``[L, Hkv, n]``) of one window through kvlab's kvzip cache."""
    from kvlab.engine.generation import prefill
    from kvlab.policies import make_policy

    layers = model.model.layers
    seen: dict[int, torch.Tensor] = {}

    def grab(module, args, kwargs):
        seen.setdefault(module.layer_idx, kwargs["hidden_states"][0].detach().clone())

    hooks = [layer.self_attn.register_forward_pre_hook(grab, with_kwargs=True) for layer in layers]
    policy = make_policy("kvzip", keep=0.5, n_sink=n_sink)
    try:
        with torch.no_grad(), policy.attach(model, warm=False):
            cache = policy.make_cache(model)
            prefill(model, ids, cache)
    finally:
        for hook in hooks:
            hook.remove()
    hidden = torch.stack([seen[i] for i in range(len(layers))])
    scores = torch.stack([layer.kvzip_scores[0] for layer in cache.layers])
    return hidden, scores.clamp(min=1e-30).log()


def ridge(x: torch.Tensor, y: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[m, D]``, ``y`` ``[m, H]`` -> (``W`` ``[H, D]``, ``b`` ``[H]``): sklearn ``Ridge(alpha)``."""
    x, y = x.double(), y.double()
    mx, my = x.mean(0), y.mean(0)
    xc, yc = x - mx, y - my
    gram = xc.T @ xc + alpha * torch.eye(x.shape[1], dtype=x.dtype)
    w = torch.linalg.solve(gram, xc.T @ yc).T
    return w.float(), (my - w @ mx).float()


def ranks(v: torch.Tensor) -> torch.Tensor:
    return v.argsort(-1).argsort(-1).double()


def spearman(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(-1, keepdim=True), rb - rb.mean(-1, keepdim=True)
    return (ra * rb).sum(-1) / (ra.norm(dim=-1) * rb.norm(dim=-1))


def topk_jaccard(pred: torch.Tensor, true: torch.Tensor, k: int) -> torch.Tensor:
    a = torch.zeros_like(pred, dtype=torch.bool).scatter_(-1, pred.topk(k, -1).indices, True)
    b = torch.zeros_like(true, dtype=torch.bool).scatter_(-1, true.topk(k, -1).indices, True)
    return (a & b).sum(-1).double() / (a | b).sum(-1).double()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per window")
    parser.add_argument("--train", type=int, default=24, help="train windows")
    parser.add_argument("--test", type=int, default=4, help="test windows")
    parser.add_argument("--test-fraction", type=float, default=0.2)
    parser.add_argument("--per-window", type=int, default=512, help="train positions sampled per window")
    parser.add_argument("--alpha", type=float, default=1.0)
    parser.add_argument("--n-sink", type=int, default=4)
    parser.add_argument("--keeps", type=float, nargs="+", default=[0.25, 0.5])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "kvlab" / "data" / "kvzap")
    parser.add_argument("--log", type=Path, required=True)
    args = parser.parse_args(argv)

    from kvlab.models import load_model
    from kvlab.policies.kvzap import save_surrogate
    from kvlab.quality.continuation import stdlib_text

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    loaded = load_model("smollm2-135m", weights="real")
    model = loaded.model
    text, source = stdlib_text()
    ids = torch.tensor(loaded.tokenizer(text, add_special_tokens=False).input_ids)
    cut = int(len(ids) * (1 - args.test_fraction))
    train_at = windows(len(ids), args.tokens, args.train, 0, cut, args.seed)
    test_at = windows(len(ids), args.tokens, args.test, cut, len(ids), args.seed + 1)
    gen = torch.Generator().manual_seed(args.seed)
    xs, ys, tests = [], [], []
    for i, off in enumerate(train_at + test_at):
        hidden, target = collect(model, ids[off:off + args.tokens][None], args.n_sink)
        hidden, target = hidden[:, args.n_sink:], target[..., args.n_sink:]
        if i < len(train_at):
            pick = torch.randperm(hidden.shape[1], generator=gen)[:args.per_window]
            xs.append(hidden[:, pick])
            ys.append(target[..., pick])
        else:
            tests.append((hidden, target))
        print(f"window {i + 1}/{len(train_at) + len(test_at)} at {off}: {time.perf_counter() - started:.0f} s", flush=True)
    collect_s = time.perf_counter() - started
    x = torch.cat(xs, dim=1)  # [L, m, D]
    y = torch.cat(ys, dim=2)  # [L, H, m]
    num_layers = x.shape[0]
    fits = [ridge(x[layer], y[layer].T, args.alpha) for layer in range(num_layers)]
    weight = torch.stack([w for w, _ in fits])
    bias = torch.stack([b for _, b in fits])

    r2, rho, jac = [], [], {k: [] for k in args.keeps}
    for hidden, target in tests:
        pred = torch.einsum("lnd,lhd->lhn", hidden, weight) + bias[..., None]
        resid = ((target - pred) ** 2).sum(-1)
        total = ((target - target.mean(-1, keepdim=True)) ** 2).sum(-1)
        r2.append(1 - resid / total)  # [L, H]
        rho.append(spearman(pred, target))
        for keep in args.keeps:
            jac[keep].append(topk_jaccard(pred, target, int(target.shape[-1] * keep)))
    r2_t, rho_t = torch.stack(r2).double().mean(0), torch.stack(rho).mean(0)
    args.out.mkdir(parents=True, exist_ok=True)
    spec = loaded.spec
    path = args.out / f"linear-L{spec.num_layers}-H{spec.num_kv_heads}-D{spec.hidden_size}.safetensors"
    meta = {"model": "smollm2-135m", "targets": "log kvlab kvzip scores", "text": source,
            "command": "python scripts/train_kvzap.py " + " ".join(sys.argv[1:])}
    save_surrogate(path, weight, bias, meta)
    log = {
        "model": "smollm2-135m (real weights, float32, CPU)", "surrogate": str(path.resolve().relative_to(ROOT)) if path.resolve().is_relative_to(ROOT) else str(path),
        "command": meta["command"], "text": source, "text_tokens": len(ids), "train_offsets": train_at,
        "test_offsets": test_at, "train_rows": int(x.shape[1]), "test_rows_per_window": args.tokens - args.n_sink,
        "alpha": args.alpha, "n_sink_left_out": args.n_sink, "threads": args.threads,
        "held_out": {
            "r2_mean": round(r2_t.mean().item(), 4),
            "r2_per_layer": [round(v, 4) for v in r2_t.mean(-1).tolist()],
            "spearman_mean": round(rho_t.mean().item(), 4),
            "spearman_per_layer": [round(v, 4) for v in rho_t.mean(-1).tolist()],
            "topk_jaccard_vs_kvzip": {str(k): round(torch.stack(v).mean().item(), 4) for k, v in jac.items()},
        },
        "collect_s": round(collect_s, 1), "total_s": round(time.perf_counter() - started, 1),
        "torch": torch.__version__, "python": platform.python_version(),
    }
    args.log.parent.mkdir(parents=True, exist_ok=True)
    args.log.write_text(json.dumps(log, indent=1) + "\n")
    print(json.dumps(log["held_out"], indent=1))


if __name__ == "__main__":
    main()
