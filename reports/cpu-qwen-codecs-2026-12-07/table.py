"""The README's tables, recomputed from this folder's records (continuation/records.jsonl, needle-4k/records.jsonl).

    python reports/cpu-qwen-codecs-2026-12-07/table.py
"""

from pathlib import Path

from kvlab.models import get_spec
from kvlab.policies import make_policy
from kvlab.records import read_jsonl

HERE = Path(__file__).parent
HEAD_DIM = get_spec("qwen2.5-coder-1.5b").head_dim
# (store, bits, without the rotation, with it): the same store and knobs, label as recorded
PAIRS = [("kvq int4-g64, no key offset", 4, "kvq int4-g64", "kvq-rot int4-g64"),
         ("kvq int2-g64, no key offset", 2, "kvq int2-g64", "kvq-rot int2-g64"),
         ("kivi k4v4 (per-channel keys, R128)", 4, "kivi k4v4", "kivi-rot k4v4"),
         ("kivi k2v2 (per-channel keys, R128)", 2, "kivi k2v2", "kivi-rot k2v2")]


def bits_per_element(policy_params: dict) -> float:
    """Stored bits per K/V element at Qwen's head dim, scales and norms included (KIVI: a quantized
    token's, the 128-token bf16 ring aside; kvq's key offset: per sequence, not per token)."""
    params = {k: v for k, v in policy_params.items() if k not in ("method", "keep", "bits", "backend")}
    if policy_params["method"] == "full":
        return 16.0
    if policy_params["method"].startswith("kvq-int"):
        params = {"key_offset": params.get("key_offset", "none"), "q_group_size": params["q_group_size"]}
    storage = make_policy(policy_params["method"], **params).storage()
    return storage.token_bytes(1, HEAD_DIM) * 8 / (2 * HEAD_DIM)


def main() -> None:
    cont = [r for r in read_jsonl(HERE / "continuation" / "records.jsonl") if r["status"] == "ok"]
    by_label = {r["label"]: r for r in cont}
    print("| store | bits/elt | KL vs full | top-1 agree | continuation NLL |\n|---|---|---|---|---|")
    for r in cont:
        print(f"| {r['label']} | {bits_per_element(r['policy_params']):.2f} | {r['kl']:.4f} | "
              f"{r['top1_agree']:.3f} | {r['cont_nll']:.3f} |")
    print("\n| store | bits | KL without rotation | KL with rotation | ratio |\n|---|---|---|---|---|")
    for name, bits, plain, rot in PAIRS:
        if plain in by_label and rot in by_label:
            a, b = by_label[plain]["kl"], by_label[rot]["kl"]
            print(f"| {name} | {bits} | {a:.4f} | {b:.4f} | {b / a:.2f}x |")
    needle = HERE / "needle-4k" / "records.jsonl"
    if needle.exists():
        print("\n| store | depth | reply | found | gold NLL | answer KL vs full |\n|---|---|---|---|---|---|")
        for r in read_jsonl(needle):
            reply = (r.get("reply") or r.get("prediction") or "").replace("\n", " ")[:40]
            print(f"| {r['label']} | {r['depth']} | `{reply}` | {r['score']} | {r['gold_nll']:.3f} | {r['kl']:.4f} |")


if __name__ == "__main__":
    main()
