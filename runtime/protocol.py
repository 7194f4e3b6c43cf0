"""The OpenAI wire format the server speaks: request models (pydantic) and response builders.

Requests: :class:`CompletionRequest` (POST /v1/completions) and :class:`ChatRequest` (POST /v1/chat/completions),
with vLLM's ``stop_token_ids`` / ``ignore_eos`` and sharpdraft's ``speculative`` / ``query_scale`` /
``num_draft_tokens`` extensions. Responses: :class:`CompletionShape` and :class:`ChatShape` build the non-streamed
body and the streamed chunks of each endpoint (OpenAI's ``text_completion`` / ``chat.completion`` /
``chat.completion.chunk`` objects); :func:`error_body` the error object. runtime/serve.py runs the requests.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from runtime.sampling import SEED_MAX, SEED_MIN

ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error",
               429: "rate_limit_error"}


def check_text(value, where: str):
    """Refuse text that is not valid Unicode: JSON can carry a lone UTF-16 surrogate (``"\\ud800"``), which no
    tokenizer can encode. ``value``: a str, or a list of them (other values pass through). Returns ``value``.

    Raises:
        ValueError: names ``where``, the character index and what to send instead (pydantic makes it a 400).
    """
    for i, text in enumerate([value] if isinstance(value, str) else value if isinstance(value, list) else []):
        if not isinstance(text, str):
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            at = f"{where}[{i}]" if isinstance(value, list) else where
            raise ValueError(f"{at} is not valid Unicode: a lone UTF-16 surrogate ({text[e.start]!a}) at character "
                             f"{e.start}; send well-formed text (surrogates only in high-low pairs)") from None
    return value


class CommonRequest(BaseModel):
    """Fields both endpoints take (OpenAI's, vLLM's extensions, sharpdraft's A/B switches)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)  # choice i of n draws with seed + i (sampling.py)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=16)  # choices; protocol.MAX_N
    stream: bool = Field(False, strict=True)
    stream_options: dict[str, Any] | None = None
    logprobs: int | bool | None = None  # completions: an int 0..20; chat: a bool (with top_logprobs 0..20)
    top_logprobs: int | None = None
    spec_stats: bool = Field(False, strict=True)  # sharpdraft extension: add the "sharpdraft" statistics block
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    speculative: bool = Field(True, strict=True)  # sharpdraft extension: false = target-only decoding for this request
    num_draft_tokens: int | None = Field(None, ge=0)  # sharpdraft extension
    # sharpdraft extension: false = this request drafts with beta = 1 (the frozen drafter)
    query_scale: bool = Field(True, strict=True)

    @field_validator("stop")
    @classmethod
    def _valid_stop(cls, v):
        return check_text(v, "stop")


class CompletionRequest(CommonRequest):
    max_tokens: int | None = Field(None, ge=0)  # 0: score the prompt only (echo + logprobs), as lm-eval does
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = Field(False, strict=True)
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (list, str)):
            if len(v) != 1:
                raise ValueError("batched prompts are not supported: send one prompt per request")
            v = v[0]
        if isinstance(v, list) and not v:
            raise ValueError("prompt is empty: give text or at least one token id")
        return check_text(v, "prompt")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _valid_content(self):
        # OpenAI takes a null content only from the assistant (a message that carried tool calls); elsewhere it is
        # a 400, as here
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content (a string or a list of text parts), got null")
        if isinstance(self.content, list):
            for part in self.content:
                check_text(part.get("text"), "content part text")
        return self

    @field_validator("content")
    @classmethod
    def _valid_text(cls, v):
        return check_text(v, "content") if isinstance(v, str) else v

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text content parts are supported, got {part.get('type')!r}")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


def error_body(status: int, message: str) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "code"}}``."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "code": status}}


def usage(prompt_len: int, n: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n}


def sse(obj: dict | str) -> str:
    """One server-sent event (``data: ...`` and a blank line)."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, allow_nan=False)}\n\n"


MAX_N = 16  # choices per request (each is a sequence in the batch)


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


class CompletionShape:
    """Bodies and chunks of POST /v1/completions (OpenAI ``text_completion``).

    ``logprobs`` in OpenAI's completions form: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``,
    one entry per generated token; ``top_logprobs[i]`` maps the n most likely tokens' text (and the chosen one's)
    to their log-probabilities.
    """

    endpoint = "completions"
    id_prefix = "cmpl"
    chunk_object = "text_completion"

    def __init__(self, model: str, tokenizer=None):
        self.model, self.tokenizer = model, tokenizer

    def choice(self, index: int, text: str, finish_reason: str | None, logprobs, offset: int = 0,
               prompt: tuple[list[int], list] | None = None) -> dict:
        return {"index": index, "text": text, "logprobs": self.logprobs(logprobs, offset, prompt),
                "finish_reason": finish_reason}

    def logprobs(self, lps, offset: int = 0, prompt: tuple[list[int], list] | None = None) -> dict | None:
        """``lps``: list of :class:`runtime.sampling.TokenLogprob` (None: not requested). ``offset``: characters
        of text before the first token (the echoed prompt, earlier chunks). ``prompt``: (prompt ids, their
        TokenLogprobs for tokens 1..n-1) to list first, as ``echo`` with ``logprobs`` does; the first prompt
        token has no logprob (``None``), as in OpenAI's and vLLM's answers."""
        if lps is None:
            return None
        tokens, offsets, top, values = [], [], [], []
        if prompt is not None:
            ids, plps = prompt
            offset = 0
            for i, tid in enumerate(ids):
                t = _token_text(self.tokenizer, tid)
                tokens.append(t)
                offsets.append(offset)
                offset += len(t)
                if i == 0:
                    values.append(None)
                    top.append(None)
                else:
                    lp = plps[i - 1]
                    values.append(lp.logprob)
                    alts = {_token_text(self.tokenizer, j): v for j, v in lp.top}
                    alts.setdefault(t, lp.logprob)
                    top.append(alts)
        for lp in lps:
            t = _token_text(self.tokenizer, lp.token_id)
            tokens.append(t)
            offsets.append(offset)
            offset += len(t)
            alts = {_token_text(self.tokenizer, i): v for i, v in lp.top}
            alts.setdefault(t, lp.logprob)
            top.append(alts)
            values.append(lp.logprob)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": top, "text_offset": offsets}

    def body(self, rid: str, created: int, choices: list[dict], use: dict, extra: dict | None) -> dict:
        out = {"id": rid, "object": "text_completion", "created": created, "model": self.model,
               "choices": choices, "usage": use}
        if extra is not None:
            out["sharpdraft"] = extra
        return out

    def chunk(self, rid: str, created: int, index: int, text: str, finish_reason: str | None, logprobs=None,
              offset: int = 0, first: bool = False) -> dict | None:
        if first and not text:  # the first chunk carries the echoed prompt, if any
            return None
        return {"id": rid, "object": self.chunk_object, "created": created, "model": self.model,
                "choices": [self.choice(index, text, finish_reason, logprobs, offset)]}

    def usage_chunk(self, rid: str, created: int, use: dict) -> dict:
        return {"id": rid, "object": self.chunk_object, "created": created, "model": self.model, "choices": [],
                "usage": use}


class ChatShape(CompletionShape):
    """Bodies and chunks of POST /v1/chat/completions (OpenAI ``chat.completion`` / ``chat.completion.chunk``).

    ``logprobs`` in OpenAI's chat form: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}],
    "refusal": None}``.
    """

    endpoint = "chat"
    id_prefix = "chatcmpl"
    chunk_object = "chat.completion.chunk"

    def choice(self, index, text, finish_reason, logprobs, offset=0, prompt=None):
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": self.logprobs(logprobs), "finish_reason": finish_reason}

    def logprobs(self, lps, offset: int = 0) -> dict | None:
        if lps is None:
            return None

        def entry(token_id: int, value: float) -> dict:
            t = _token_text(self.tokenizer, token_id)
            return {"token": t, "logprob": value, "bytes": list(t.encode("utf-8"))}

        return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                            for lp in lps], "refusal": None}

    def body(self, rid, created, choices, use, extra):
        out = {"id": rid, "object": "chat.completion", "created": created, "model": self.model,
               "choices": choices, "usage": use}
        if extra is not None:
            out["sharpdraft"] = extra
        return out

    def chunk(self, rid, created, index, text, finish_reason, logprobs=None, offset=0, first=False):
        delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
        return {"id": rid, "object": self.chunk_object, "created": created, "model": self.model,
                "choices": [{"index": index, "delta": delta, "logprobs": self.logprobs(logprobs),
                             "finish_reason": finish_reason}]}
