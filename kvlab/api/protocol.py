"""OpenAI's completions and chat-completions bodies: a request body in, a checked :class:`Job` out;
a job's tokens in, the response and stream-chunk bodies out. Pure functions, no I/O.

Decoding is greedy (the serving engine's only mode): sampling fields (``temperature``, ``top_p``,
``seed``...) are accepted and ignored. ``ignore_eos`` (vLLM's extension, which load generators
send) makes a request run to ``max_tokens``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

COMPLETIONS = "completions"
CHAT = "chat"
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class APIError(Exception):
    """A request the server refuses: an HTTP status and the API's error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Job:
    """One checked request: what the engine runs and how the answer is shaped."""

    kind: str  # COMPLETIONS or CHAT
    model: str
    prompt_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    ignore_eos: bool
    request_id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, else a 400 naming what is wrong with it."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise APIError(400, f"malformed JSON body: {err}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the body must be a JSON object, not {type(body).__name__}")
    return body


def _int_field(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise APIError(400, f"{name} must be an integer, not {value!r}", param=name)
    return value


def _bool_field(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise APIError(400, f"{name} must be true or false, not {value!r}", param=name)
    return value


def _token_ids(value: Any, vocab_size: int) -> list[int] | None:
    """A prompt given as token ids (a list of ints, or a list holding one such list), else None."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list):
        value = value[0]
    if not (isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool)
                                                      for v in value)):
        return None
    bad = [v for v in value if not 0 <= v < vocab_size]
    if bad:
        raise APIError(400, f"prompt token ids must lie in [0, {vocab_size}): got {bad[:3]}", param="prompt")
    return list(value)


def prompt_ids(body: dict, tokenizer, vocab_size: int) -> list[int]:
    """/v1/completions' ``prompt``: a string, token ids, or a one-item list of either."""
    prompt = body.get("prompt")
    ids = _token_ids(prompt, vocab_size)
    if ids is not None:
        return ids
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list) and len(prompt) > 1:
        raise APIError(400, f"one prompt per request (got {len(prompt)}): send them as separate requests",
                       param="prompt")
    if not isinstance(prompt, str) or not prompt:
        raise APIError(400, "prompt must be a non-empty string or a list of token ids", param="prompt")
    return list(tokenizer.encode(prompt))


def _message_text(content: Any) -> str:
    """A message's content: a string, or a list of parts whose text parts are joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type") != "text" for p in content):
            raise APIError(400, "only text content parts are supported", param="messages")
        return "".join(str(p.get("text", "")) for p in content)
    raise APIError(400, "a message's content must be a string or a list of text parts", param="messages")


def chat_ids(body: dict, tokenizer) -> list[int]:
    """/v1/chat/completions' ``messages`` through the tokenizer's chat template."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", param="messages")
    turns = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, "each message needs a role and a content", param="messages")
        turns.append({"role": m["role"], "content": _message_text(m.get("content"))})
    text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def parse_job(kind: str, body: dict, *, served_model: str, tokenizer, vocab_size: int,
              max_model_len: int) -> Job:
    """A checked :class:`Job`, or an :class:`APIError` naming the field and the fix."""
    model = body.get("model", served_model)
    if model != served_model:
        raise APIError(404, f"the model {model!r} does not exist: this server serves {served_model!r}",
                       param="model", code="model_not_found")
    n = _int_field(body, "n")
    if n not in (None, 1):
        raise APIError(400, f"n={n}: one choice per request", param="n")
    ids = chat_ids(body, tokenizer) if kind == CHAT else prompt_ids(body, tokenizer, vocab_size)
    room = max_model_len - len(ids)
    if room < 1:
        raise APIError(400, f"the prompt has {len(ids)} tokens; this model's context is {max_model_len}: "
                            f"shorten the prompt", param="prompt" if kind == COMPLETIONS else "messages",
                       code="context_length_exceeded")
    name = "max_completion_tokens" if kind == CHAT and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = _int_field(body, name)
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS if kind == COMPLETIONS else room
    if max_tokens <= 0:
        raise APIError(400, f"{name}={max_tokens}: ask for at least 1 token", param=name)
    if max_tokens > room:
        raise APIError(400, f"the prompt ({len(ids)} tokens) plus {name}={max_tokens} exceeds this model's "
                            f"context of {max_model_len}: ask for at most {room}", param=name,
                       code="context_length_exceeded")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise APIError(400, "stream_options must be an object", param="stream_options")
    return Job(kind=kind, model=served_model, prompt_ids=ids, max_tokens=max_tokens,
               stream=_bool_field(body, "stream", False),
               include_usage=bool((options or {}).get("include_usage", False)),
               ignore_eos=_bool_field(body, "ignore_eos", False))


def usage(job: Job, completion_tokens: int) -> dict[str, int]:
    prompt = len(job.prompt_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens}


def _head(job: Job, chunk: bool) -> dict[str, Any]:
    obj = ("chat.completion.chunk" if chunk else "chat.completion") if job.kind == CHAT else "text_completion"
    return {"id": job.request_id, "object": obj, "created": job.created, "model": job.model}


def stream_chunk(job: Job, text: str, finish_reason: str | None, first: bool) -> dict[str, Any]:
    """One SSE chunk carrying a token's text (and the finish reason on the last)."""
    if job.kind == CHAT:
        delta: dict[str, Any] = {"content": text}
        if first:
            delta["role"] = "assistant"
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {**_head(job, True), "choices": [choice]}


def usage_chunk(job: Job, completion_tokens: int) -> dict[str, Any]:
    """The last chunk when ``stream_options.include_usage`` is set: no choices, the usage."""
    return {**_head(job, True), "choices": [], "usage": usage(job, completion_tokens)}


def full_response(job: Job, text: str, finish_reason: str | None, completion_tokens: int) -> dict[str, Any]:
    """The non-streaming answer."""
    if job.kind == CHAT:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {**_head(job, False), "choices": [choice], "usage": usage(job, completion_tokens)}


def sse(obj: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line (``[DONE]`` as given)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
