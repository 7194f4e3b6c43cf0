"""OpenAI-compatible HTTP server over an engines/ folder (FastAPI + uvicorn; 127.0.0.1 by default).

    python -m runtime.serve --engine engines/ [--host 127.0.0.1] [--port 8000] [--max-running 8] [--max-waiting 64]
                            [--backend onnxruntime|torch]

Endpoints: POST /v1/completions, POST /v1/chat/completions (the tokenizer's chat template), both with
``stream: true`` as server-sent events; GET /v1/models, GET /health, GET /metrics (Prometheus text format).
Simultaneous requests share engine steps (continuous batching, runtime/async_engine.py); when every running slot
and waiting place is taken the server answers 429 with Retry-After. A client that disconnects is aborted at once.

Request fields: model, prompt / messages, max_tokens (chat also max_completion_tokens), temperature, top_p, top_k,
seed, stop, stop_token_ids, ignore_eos, n (1 only), stream, stream_options.include_usage, echo (completions), and
the sharpdraft extensions ``speculative`` (false: target-only decoding for this request), ``query_scale`` (false:
this request drafts with beta = 1, the frozen drafter; both for A/B comparisons in one server) and
``num_draft_tokens``. Fields the server cannot honour (n > 1, logprobs, non-zero penalties, logit_bias, best_of > 1)
are refused with 400 and say so; unknown fields are ignored like OpenAI does.
"""
from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any, Literal

import click
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from pydantic import BaseModel, ConfigDict, Field, field_validator

from runtime.async_engine import AsyncEngine, QueueFull, RequestStream
from runtime.sampling import SamplingParams
from runtime.server_metrics import ServerMetrics
from runtime.stops import TextDeltas

DISCONNECT_POLL_S = 0.25
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    ignore_eos: bool = False
    n: int = Field(1, ge=1)
    stream: bool = Field(False, strict=True)
    stream_options: dict[str, Any] | None = None
    logprobs: int | bool | None = None
    top_logprobs: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    speculative: bool = Field(True, strict=True)  # sharpdraft extension: false = target-only decoding for this request
    num_draft_tokens: int | None = Field(None, ge=0)  # sharpdraft extension
    query_scale: bool = Field(True, strict=True)  # sharpdraft extension: false = this request drafts with beta = 1 (frozen drafter)


class CompletionRequest(_Common):
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
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text content parts are supported, got {part.get('type')!r}")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    kind = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error",
            429: "rate_limit_error"}.get(status, "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status,
                        headers=headers)


class _ResponseGate:
    """ASGI middleware: refuses bodies over ``max_body_bytes`` (by Content-Length) with 413, and counts every answer
    of the API endpoints by status (streams: their 200 at start) in ``metrics``."""

    def __init__(self, app, metrics: ServerMetrics, max_body_bytes: int):
        self.app, self.metrics, self.max_body_bytes = app, metrics, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = ENDPOINTS.get(scope["path"])
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            if endpoint is not None:
                self.metrics.request_done(endpoint, 413)
            response = _error(413, f"request body of {int(length)} bytes exceeds the server's limit of "
                                   f"{self.max_body_bytes} bytes; send a shorter prompt")
            return await response(scope, receive, send)

        async def counted(message):
            if message["type"] == "http.response.start" and endpoint is not None:
                self.metrics.request_done(endpoint, message["status"])
            await send(message)

        await self.app(scope, receive, counted)


MAX_BODY_BYTES = 4 << 20  # 4 MiB: far above any prompt of the target's context (8k tokens are ~40 kB of text)


def create_app(async_engine: AsyncEngine, model_name: str = "sharpdraft", default_max_tokens: int = 16,
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """Build the app around a started-or-not :class:`AsyncEngine` (the app starts and stops its worker).

    ``max_body_bytes``: larger request bodies are refused with 413 before they are read.
    Raises nothing itself; request errors become OpenAI-style error objects (400 / 404 / 413 / 429 / 500).
    """
    from contextlib import asynccontextmanager

    engine = async_engine.engine
    metrics = ServerMetrics(async_engine)
    async_engine.on_step = metrics.on_step

    @asynccontextmanager
    async def lifespan(_app):
        if not async_engine._thread.is_alive():
            async_engine.start()
        yield
        async_engine.shutdown()

    app = FastAPI(title="sharpdraft", version="0.2.0", lifespan=lifespan)
    app.state.metrics = metrics

    @app.exception_handler(RequestValidationError)
    async def bad_request(_, exc: RequestValidationError) -> JSONResponse:
        # OpenAI answers malformed requests with 400 and an error object, not FastAPI's 422.
        msg = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors())
        if any(e.get("type") == "json_invalid" for e in exc.errors()):
            msg = "request body is not valid JSON: " + msg
        return _error(400, msg)

    @app.exception_handler(StarletteHTTPException)  # also unknown paths / methods (404 / 405), OpenAI-style
    async def http_error(_, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), getattr(exc, "headers", None))

    # a pure ASGI middleware: Starlette's BaseHTTPMiddleware (``@app.middleware``) wraps ``receive``, and the
    # handlers' request.is_disconnected() then never sees a non-streaming client hang up
    app.add_middleware(_ResponseGate, metrics=metrics, max_body_bytes=max_body_bytes)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", **async_engine.stats()}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "sharpdraft"}]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    def params_of(req: _Common, max_tokens: int | None) -> SamplingParams:
        if req.model not in (None, model_name):
            raise HTTPException(404, f"model {req.model!r} does not exist; this server serves {model_name!r}")
        unsupported = [name for name, bad in (
            ("n > 1", req.n > 1), ("logprobs", req.logprobs not in (None, False)),
            ("frequency_penalty", req.frequency_penalty != 0), ("presence_penalty", req.presence_penalty != 0),
            ("logit_bias", bool(req.logit_bias)), ("best_of > 1", (getattr(req, "best_of", None) or 1) > 1)) if bad]
        if req.top_logprobs is not None and req.logprobs in (None, False, 0):
            raise HTTPException(400, f"top_logprobs ({req.top_logprobs}) needs logprobs: true (OpenAI chat "
                                     "semantics); set logprobs or remove top_logprobs")
        if unsupported:
            raise HTTPException(400, f"{', '.join(unsupported)}: not supported by this server; remove it")
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        try:
            return SamplingParams(max_new_tokens=max_tokens or default_max_tokens, temperature=req.temperature,
                                  top_p=req.top_p, top_k=req.top_k, seed=req.seed, stop=stop,
                                  stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
                                  speculative=req.speculative, num_draft_tokens=req.num_draft_tokens,
                                  query_scale=req.query_scale)
        except ValueError as e:
            raise HTTPException(400, str(e)) from e

    def ab(params: SamplingParams) -> dict:
        """The A/B switches this request ran with (echoed in the response's ``sharpdraft`` block)."""
        qs = (engine.manifest or {}).get("query_scale", {})
        return {"speculative": params.speculative,
                "query_scale": bool(params.query_scale and params.speculative and qs.get("enabled", False))}

    def submit(ids: list[int], params: SamplingParams, max_tokens_field: str | None) -> RequestStream:
        """Queue the request; 429 at capacity, 400 for a request the engine refuses (its message names the
        request's own field, ``max_tokens_field``, or says the server default applied)."""
        try:
            return async_engine.submit(ids, params)
        except QueueFull as e:
            raise HTTPException(429, str(e), headers={"Retry-After": str(e.retry_after_s)}) from e
        except ValueError as e:
            n = params.max_new_tokens
            label = (f"{max_tokens_field} ({n})" if max_tokens_field else
                     f"max_tokens ({n}: not sent, the server's default)")
            raise HTTPException(400, str(e).replace(f"max_new_tokens ({n})", label).replace(
                "lower max_new_tokens", f"lower {max_tokens_field or 'max_tokens'}")) from e

    async def collect(request: Request, stream: RequestStream):
        """Wait for the result; abort the request if the client goes away first.

        The connection is checked every ``DISCONNECT_POLL_S`` seconds whether or not tokens keep arriving (a busy
        request emits an event every step, so checking only on a quiet poll would never notice the hang-up)."""
        next_check = time.monotonic() + DISCONNECT_POLL_S
        while True:
            event = await stream.next_event(DISCONNECT_POLL_S)
            if event is not None:
                if event.error is not None:
                    raise HTTPException(500, event.error)
                if event.result is not None:
                    return event.result
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    stream.abort()
                    metrics.aborted.labels(ENDPOINTS.get(request.url.path, "other")).inc()
                    return None

    def usage(prompt_len: int, n: int) -> dict:
        return {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n}

    def sse(obj: dict | str) -> str:
        return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"

    async def run(request: Request, req: _Common, ids: list[int], params: SamplingParams, endpoint: str,
                  make_body, make_chunk, prefix: str = ""):
        if not ids:
            raise HTTPException(400, "prompt encodes to zero tokens; give a non-empty prompt")
        stream = submit(ids, params, next((f for f in ("max_completion_tokens", "max_tokens")
                                           if getattr(req, f, None) is not None), None))
        rid = f"{'chatcmpl' if endpoint == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        if not req.stream:
            result = await collect(request, stream)
            if result is None:
                return Response(status_code=499)
            metrics.request_finished(endpoint, stream, result, len(ids))
            return JSONResponse(make_body(rid, created, prefix + (result.text or ""), result,
                                          usage(len(ids), len(result.token_ids))))
        include_usage = bool((req.stream_options or {}).get("include_usage"))

        async def events():
            deltas = TextDeltas(engine.tokenizer, params.stop)
            generated: list[int] = []
            finished = False
            try:
                first = make_chunk(rid, created, prefix, None, first=True)
                if first is not None:
                    yield sse(first)
                async for event in stream:
                    if event.error is not None:
                        yield sse({"error": {"message": event.error, "type": "server_error", "code": 500}})
                        finished = True
                        return
                    generated.extend(event.token_ids)
                    final = event.result.text or "" if event.result is not None else None
                    text = deltas.delta(generated, final)
                    if text:
                        yield sse(make_chunk(rid, created, text, None))
                    if event.result is not None:
                        yield sse(make_chunk(rid, created, "", event.result.finish_reason))
                        if include_usage:
                            yield sse({"id": rid, "object": "chat.completion.chunk" if endpoint == "chat"
                                       else "text_completion", "created": created, "model": req.model or model_name,
                                       "choices": [], "usage": usage(len(ids), len(event.result.token_ids))})
                        metrics.request_finished(endpoint, stream, event.result, len(ids))
                        finished = True
                yield sse("[DONE]")
            finally:
                if not finished:  # client went away (generator closed) or the loop was cancelled
                    stream.abort()
                    metrics.aborted.labels(endpoint).inc()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        params = params_of(req, req.max_tokens)
        ids = engine.tokenizer.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
        prefix = (req.prompt if isinstance(req.prompt, str) else engine.tokenizer.decode(ids)) if req.echo else ""

        def body(rid, created, text, result, use):
            return {"id": rid, "object": "text_completion", "created": created, "model": req.model or model_name,
                    "choices": [{"index": 0, "text": text, "logprobs": None,
                                 "finish_reason": result.finish_reason}],
                    "usage": use, "sharpdraft": {**result.stats.to_dict(), **ab(params)}}

        def chunk(rid, created, text, finish_reason, first=False):
            if first and not text:
                return None
            return {"id": rid, "object": "text_completion", "created": created, "model": req.model or model_name,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}

        return await run(request, req, ids, params, "completions", body, chunk, prefix)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        params = params_of(req, req.max_completion_tokens or req.max_tokens)
        try:
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        except ValueError as e:
            raise HTTPException(400, str(e)) from e
        if engine.tokenizer.chat_template is None:
            raise HTTPException(400, "this model's tokenizer has no chat template; use /v1/completions")
        ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                   return_dict=False)

        def body(rid, created, text, result, use):
            return {"id": rid, "object": "chat.completion", "created": created, "model": req.model or model_name,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "logprobs": None, "finish_reason": result.finish_reason}],
                    "usage": use, "sharpdraft": {**result.stats.to_dict(), **ab(params)}}

        def chunk(rid, created, text, finish_reason, first=False):
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            return {"id": rid, "object": "chat.completion.chunk", "created": created,
                    "model": req.model or model_name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}

        return await run(request, req, list(ids), params, "chat", body, chunk)

    return app


def wait_healthy(url: str, timeout_s: float = 60.0, path: str = "/health") -> bool:
    """Poll ``url + path`` until it answers 200; False after ``timeout_s`` seconds (scripts and tests that start a
    server)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + path, timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    return False


@click.command()
@click.option("--engine", "engine_dir", default="engines", type=click.Path(path_type=Path), show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True)
@click.option("--device", default="auto", type=click.Choice(["auto", "cpu", "cuda"]))
@click.option("--backend", default="onnxruntime", show_default=True, type=click.Choice(["onnxruntime", "torch"]),
              help="torch: rebuild the pair from the manifest's sources in PyTorch (drafter on the fused op)")
@click.option("--max-running", default=8, show_default=True, type=click.IntRange(min=1),
              help="requests batched into each engine step")
@click.option("--max-waiting", default=64, show_default=True, type=click.IntRange(min=0),
              help="queued requests beyond the running ones before 429")
@click.option("--model-name", default=None, help="id served at /v1/models (default: the engines folder's name)")
def main(engine_dir: Path, host: str, port: int, device: str, backend: str, max_running: int, max_waiting: int,
         model_name: str | None) -> None:
    import uvicorn

    from runtime.engine import SpecEngine
    from runtime.manifest import EngineDirError

    try:
        engine = SpecEngine.from_dir(engine_dir, device=device, backend=backend)
    except (EngineDirError, RuntimeError) as e:
        raise click.ClickException(str(e)) from e
    _ = engine.tokenizer  # load before serving
    app = create_app(AsyncEngine(engine, max_running, max_waiting), model_name or engine_dir.resolve().name)
    uvicorn.run(app, host=host, port=port, log_level="info")


if __name__ == "__main__":
    main()
