"""A byte-level tokenizer with a ChatML-like chat template, for fast task and quality tests.

Ids 0-255 are bytes; 256/257 are ``<|im_start|>``/``<|im_end|>`` (the EOS). It fits the tiny
random Llama's 512-token vocabulary, and it pairs bytes of the word "the" into one token (id 300)
so that token counts differ from character counts, as with a real tokenizer.
"""

from __future__ import annotations

import re

SPECIALS = {"<|im_start|>": 256, "<|im_end|>": 257}
THE = 300
_SPLIT = re.compile("(" + "|".join(re.escape(s) for s in SPECIALS) + ")")


class ToyTokenizer:
    eos_token_id = SPECIALS["<|im_end|>"]
    chat_template = "chatml-like"

    def __init__(self, chat: bool = True):
        if not chat:
            self.chat_template = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = []
        for part in _SPLIT.split(text):
            if part in SPECIALS:
                ids.append(SPECIALS[part])
                continue
            data = part.encode()
            i = 0
            while i < len(data):
                if data[i:i + 3] == b"the":
                    ids.append(THE)
                    i += 3
                else:
                    ids.append(data[i])
                    i += 1
        return ids

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        """The transformers call the sweep's word-noise prompts use."""
        return {"input_ids": self.encode(text, add_special_tokens)}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        inverse = {v: k for k, v in SPECIALS.items()}
        out, buf = [], bytearray()
        for t in ids:
            t = int(t)
            if t < 256:
                buf.append(t)
                continue
            out.append(buf.decode(errors="replace"))
            buf = bytearray()
            if t == THE:
                out.append("the")
            elif t in inverse and not skip_special_tokens:
                out.append(inverse[t])
        out.append(buf.decode(errors="replace"))
        return "".join(out)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        text = "<|im_start|>system\nYou are a toy.<|im_end|>\n"
        for m in messages:
            text += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
        if add_generation_prompt:
            text += "<|im_start|>assistant\n"
        return text
