"""OpenAI-compatible HTTP server over an engines/ folder (FastAPI + uvicorn; 127.0.0.1 by default).

    python -m runtime.serve --engine engines/ [--host 127.0.0.1] [--port 8000] [--max-running 8] [--max-waiting 64]
                            [--backend onnxruntime|torch]

Endpoints: POST /v1/completions, POST /v1/chat/completions (the tokenizer's chat template), both with
``stream: true`` as server-sent events; GET /v1/models, GET /health, GET /metrics (Prometheus text format).
Simultaneous requests share engine steps (continuous batching, runtime/async_engine.py); when every running slot
and waiting place is taken the server answers 429 with Retry-After. A client that disconnects is aborted at once.

Request fields: model, prompt / messages, max_tokens (chat also max_completion_tokens), temperature, top_p, top_k,
seed, stop, stop_token_ids, ignore_eos, n (1..16; choice i samples with seed + i; greedy choices are one decode,
copied), best_of (== n), logprobs (completions: 0..20 alternatives; chat: true, with top_logprobs 0..20), stream,
stream_options.include_usage, echo (completions), and the sharpdraft extensions ``speculative`` (false: target-only
decoding for this request), ``query_scale`` (false: this request drafts with beta = 1, the frozen drafter; both for
A/B comparisons in one server), ``num_draft_tokens`` and ``spec_stats`` (true: the response carries a
``sharpdraft`` block with the request's speculative statistics: rounds, accepted and drafted tokens per position,
MAL, timings). Logprobs are the target's processed distribution at each emitted position (runtime/sampling.py
``processed_logprobs``), the same with speculation on or off; completions with ``echo`` and ``logprobs`` also
score the prompt's tokens (``max_tokens: 0`` scores without generating, as lm-eval asks). Fields the server cannot
honour (non-zero penalties, logit_bias, best_of != n, streamed prompt logprobs) are refused with 400 and say so;
unknown fields are ignored like OpenAI does.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from pathlib import Path

import click
from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.async_engine import AsyncEngine, QueueFull, RequestStream
from runtime.draft_length import DEFAULT_CONFIDENCE, DraftConfidence
from runtime.draft_length import click_option as draft_confidence_option
from runtime.ort_threads import apply as apply_thread_pool
from runtime.ort_threads import click_option as thread_pool_option
from runtime.prompt_lookup import DEFAULT_SPEC as PROMPT_LOOKUP_DEFAULT
from runtime.prompt_lookup import PromptLookup
from runtime.prompt_lookup import click_option as prompt_lookup_option
from runtime.protocol import (ChatMessage, ChatRequest, ChatShape, CommonRequest, CompletionRequest,  # noqa: F401
                              CompletionShape, error_body, sse, usage)
from runtime.sampling import MAX_LOGPROBS, SamplingParams, choice_seed
from runtime.server_metrics import ServerMetrics
from runtime.stops import TextDeltas

DISCONNECT_POLL_S = 0.25
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status, headers=headers)


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


class OpenAIServing:
    """The request path both endpoints share: sampling parameters from a request, queueing (429 at capacity),
    waiting with disconnect checks, and the non-streamed or streamed (server-sent events) answer.

    Args:
        async_engine: the continuous-batching engine (runtime/async_engine.py).
        metrics: the server's Prometheus series.
        model_name: the id served at /v1/models; requests naming another model get 404.
        default_max_tokens: max tokens of a request that sends none.
    """

    def __init__(self, async_engine: AsyncEngine, metrics: ServerMetrics, model_name: str, default_max_tokens: int):
        self.async_engine, self.engine, self.metrics = async_engine, async_engine.engine, metrics
        self.model_name, self.default_max_tokens = model_name, default_max_tokens

    def params_of(self, req: CommonRequest, max_tokens: int | None, chat: bool) -> SamplingParams:
        """The request's sampling parameters (choice 0's; :meth:`choices` gives the others).

        Raises:
            HTTPException: 404 (another model), 400 (a field the server cannot honour, bad values).
        """
        if req.model not in (None, self.model_name):
            raise HTTPException(404, f"model {req.model!r} does not exist; this server serves {self.model_name!r}")
        unsupported = [name for name, bad in (
            ("frequency_penalty", req.frequency_penalty != 0), ("presence_penalty", req.presence_penalty != 0),
            ("logit_bias", bool(req.logit_bias))) if bad]
        if unsupported:
            raise HTTPException(400, f"{', '.join(unsupported)}: not supported by this server; remove it")
        best_of = getattr(req, "best_of", None)
        if best_of is not None and best_of != req.n:
            raise HTTPException(400, f"best_of ({best_of}) must equal n ({req.n}): this server returns every sample "
                                     "it draws; send n alone")
        logprobs = self._logprobs(req, chat)
        echo = bool(getattr(req, "echo", False))
        if max_tokens == 0 and not (echo and logprobs is not None and not req.stream):
            raise HTTPException(400, "max_tokens 0 scores the prompt without generating: send it with echo: true, "
                                     "logprobs: <int> and no stream (lm-eval's loglikelihood request); else "
                                     "max_tokens >= 1")
        if echo and logprobs is not None and req.stream:
            raise HTTPException(400, "echo with logprobs (prompt logprobs) is answered non-streamed; send stream: false")
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        if max_tokens == 0:
            max_tokens = 1  # the prefill scores the prompt; the one generated token is dropped from the answer
        try:
            return SamplingParams(max_new_tokens=max_tokens or self.default_max_tokens, temperature=req.temperature,
                                  top_p=req.top_p, top_k=req.top_k, seed=req.seed, stop=stop,
                                  stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
                                  speculative=req.speculative, num_draft_tokens=req.num_draft_tokens,
                                  query_scale=req.query_scale, logprobs=logprobs,
                                  prompt_logprobs=logprobs if echo else None)
        except ValueError as e:
            raise HTTPException(400, str(e)) from e

    @staticmethod
    def _logprobs(req: CommonRequest, chat: bool) -> int | None:
        """OpenAI's two forms to ``SamplingParams.logprobs`` (None, or alternatives per token). Raises 400."""
        if chat:
            if req.logprobs not in (None, True, False):
                raise HTTPException(400, f"chat logprobs is a boolean, got {req.logprobs!r}; set top_logprobs for "
                                         "alternatives")
            if req.top_logprobs is not None and not req.logprobs:
                raise HTTPException(400, f"top_logprobs ({req.top_logprobs}) needs logprobs: true (OpenAI chat "
                                         "semantics); set logprobs or remove top_logprobs")
            if not req.logprobs:
                return None
            n = req.top_logprobs or 0
            if not 0 <= n <= MAX_LOGPROBS:
                raise HTTPException(400, f"top_logprobs must be in 0..{MAX_LOGPROBS}, got {n}")
            return n
        if req.top_logprobs is not None:
            raise HTTPException(400, "top_logprobs is a chat field; completions take logprobs: <int 0..20>")
        if req.logprobs is None or req.logprobs is False:
            return None
        if isinstance(req.logprobs, bool) or not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise HTTPException(400, f"completions logprobs is an integer in 0..{MAX_LOGPROBS} (alternatives per "
                                     f"token), got {req.logprobs!r}")
        return req.logprobs

    @staticmethod
    def choices(params: SamplingParams, n: int) -> list[SamplingParams]:
        """The engine requests of ``n`` choices: choice i draws with seed ``seed + i`` (wrapped into the signed
        64-bit range: :func:`runtime.sampling.choice_seed`; seeded requests are
        reproducible choice by choice). Greedy choices are identical, so one is decoded and copied."""
        if n == 1 or params.greedy:
            return [params]
        return [dataclasses.replace(params, seed=choice_seed(params.seed, i)) for i in range(n)]

    def ab(self, params: SamplingParams) -> dict:
        """The A/B switches this request ran with (echoed in the response's ``sharpdraft`` block)."""
        enabled = bool(self.engine.manifest and self.engine.manifest.query_scale.profile.enabled)
        return {"speculative": params.speculative,
                "query_scale": bool(params.query_scale and params.speculative and enabled)}

    def submit(self, ids: list[int], params: list[SamplingParams], max_tokens_field: str | None
               ) -> list[RequestStream]:
        """Queue the request's choices (all or none); 429 at capacity, 400 for a request the engine refuses (its
        message names the request's own field, ``max_tokens_field``, or says the server default applied)."""
        try:
            return self.async_engine.submit_group(ids, params)
        except QueueFull as e:
            raise HTTPException(429, str(e), headers={"Retry-After": str(e.retry_after_s)}) from e
        except ValueError as e:
            n = params[0].max_new_tokens
            label = (f"{max_tokens_field} ({n})" if max_tokens_field else
                     f"max_tokens ({n}: not sent, the server's default)")
            raise HTTPException(400, str(e).replace(f"max_new_tokens ({n})", label).replace(
                "lower max_new_tokens", f"lower {max_tokens_field or 'max_tokens'}")) from e

    async def collect(self, request: Request, streams: list[RequestStream]):
        """Wait for every choice's result; abort them all if the client goes away first (returns None then).

        The connection is checked every ``DISCONNECT_POLL_S`` seconds whether or not tokens keep arriving (a busy
        request emits an event every step, so checking only on a quiet poll would never notice the hang-up)."""
        results = [None] * len(streams)
        next_check = time.monotonic() + DISCONNECT_POLL_S
        while any(r is None for r in results):
            for i, stream in enumerate(streams):
                if results[i] is not None:
                    continue
                event = await stream.next_event(DISCONNECT_POLL_S / len(streams))
                if event is not None:
                    if event.error is not None:
                        for other in streams:
                            other.abort()
                        raise HTTPException(500, event.error)
                    if event.result is not None:
                        results[i] = event.result
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    for stream in streams:
                        stream.abort()
                    self.metrics.aborted.labels(ENDPOINTS.get(request.url.path, "other")).inc()
                    return None
        return results

    async def run(self, request: Request, req: CommonRequest, ids: list[int], params: SamplingParams,
                  shape: CompletionShape, prefix: str = ""):
        """Run one request's ``req.n`` choices and answer in ``shape``'s format: a JSON body or a stream."""
        if not ids:
            raise HTTPException(400, "prompt encodes to zero tokens; give a non-empty prompt")
        per_choice = self.choices(params, req.n)
        streams = self.submit(ids, per_choice, next((f for f in ("max_completion_tokens", "max_tokens")
                                                     if getattr(req, f, None) is not None), None))
        rid = f"{shape.id_prefix}-{uuid.uuid4().hex}"
        created = int(time.time())
        copies = req.n // len(streams)  # greedy n > 1: one decode, n equal choices
        if not req.stream:
            results = await self.collect(request, streams)
            if results is None:
                return Response(status_code=499)
            for stream, result in zip(streams, results):
                self.metrics.request_finished(shape.endpoint, stream, result, len(ids))
            results = [r for r in results for _ in range(copies)]
            if getattr(req, "max_tokens", None) == 0:  # scoring only: drop the token the prefill sampled
                results = [dataclasses.replace(r, token_ids=[], text="", finish_reason="length",
                                               logprobs=None if r.logprobs is None else []) for r in results]
            choices = [shape.choice(i, prefix + (r.text or ""), r.finish_reason, r.logprobs, len(prefix),
                                    None if r.prompt_logprobs is None else (ids, r.prompt_logprobs))
                       for i, r in enumerate(results)]
            extra = None
            if req.spec_stats:
                stats = [r.stats.to_dict() for r in results]
                extra = {**(stats[0] if len(stats) == 1 else {"choices": stats}), **self.ab(params)}
            return JSONResponse(shape.body(rid, created, choices,
                                           usage(len(ids), sum(len(r.token_ids) for r in results)), extra))
        include_usage = bool((req.stream_options or {}).get("include_usage"))
        return StreamingResponse(self._events(streams, shape, rid, created, len(ids), params, prefix, include_usage,
                                              copies),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _events(self, streams: list[RequestStream], shape: CompletionShape, rid: str, created: int,
                      prompt_len: int, params: SamplingParams, prefix: str, include_usage: bool, copies: int):
        """Server-sent events of every choice, interleaved as their tokens arrive (choice ``index`` on each)."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream):
            async for event in stream:
                await queue.put((i, event))
            await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i, st)) for i, st in enumerate(streams)]
        deltas = [TextDeltas(self.engine.tokenizer, params.stop) for _ in streams]
        generated: list[list[int]] = [[] for _ in streams]
        offsets = [len(prefix)] * len(streams)
        done, completion_tokens = 0, 0
        finished = False
        try:
            for i in range(len(streams) * copies):
                first = shape.chunk(rid, created, i, prefix, None, first=True)
                if first is not None:
                    yield sse(first)
            while done < len(streams):
                i, event = await queue.get()
                if event is None:
                    done += 1
                    continue
                if event.error is not None:
                    yield sse(error_body(500, event.error))
                    finished = True
                    return
                generated[i].extend(event.token_ids)
                final = event.result.text or "" if event.result is not None else None
                text = deltas[i].delta(generated[i], final)
                if text or event.logprobs:
                    for c in range(copies):
                        yield sse(shape.chunk(rid, created, i * copies + c, text, None, event.logprobs, offsets[i]))
                    offsets[i] += sum(len(self.engine.tokenizer.decode([lp.token_id])) for lp in event.logprobs) \
                        if event.logprobs else len(text)
                if event.result is not None:
                    for c in range(copies):
                        yield sse(shape.chunk(rid, created, i * copies + c, "", event.result.finish_reason))
                    completion_tokens += len(event.result.token_ids) * copies
                    self.metrics.request_finished(shape.endpoint, streams[i], event.result, prompt_len)
            if include_usage:
                yield sse(shape.usage_chunk(rid, created, usage(prompt_len, completion_tokens)))
            finished = True
            yield sse("[DONE]")
        finally:
            for task in tasks:
                task.cancel()
            if not finished:  # client went away (generator closed) or the loop was cancelled
                for stream in streams:
                    stream.abort()
                self.metrics.aborted.labels(shape.endpoint).inc()


def completions_router(serving: OpenAIServing) -> APIRouter:
    """POST /v1/completions."""
    router = APIRouter()

    @router.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        params = serving.params_of(req, req.max_tokens, chat=False)
        tok = serving.engine.tokenizer
        ids = tok.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
        prefix = (req.prompt if isinstance(req.prompt, str) else tok.decode(ids)) if req.echo else ""
        return await serving.run(request, req, ids, params, CompletionShape(req.model or serving.model_name, tok),
                                 prefix)

    return router


def chat_router(serving: OpenAIServing) -> APIRouter:
    """POST /v1/chat/completions (the tokenizer's chat template)."""
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        params = serving.params_of(req, req.max_completion_tokens or req.max_tokens, chat=True)
        try:
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        except ValueError as e:
            raise HTTPException(400, str(e)) from e
        tok = serving.engine.tokenizer
        if tok.chat_template is None:
            raise HTTPException(400, "this model's tokenizer has no chat template; use /v1/completions")
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return await serving.run(request, req, list(ids), params, ChatShape(req.model or serving.model_name, tok))

    return router


def operations_router(async_engine: AsyncEngine, metrics: ServerMetrics, model_name: str) -> APIRouter:
    """GET /health, /v1/models, /metrics (Prometheus text format)."""
    router = APIRouter()

    @router.get("/health")
    async def health() -> dict:
        return {"status": "ok", **async_engine.stats()}

    @router.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "sharpdraft"}]}

    @router.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    return router


MAX_BODY_BYTES = 4 << 20  # 4 MiB: far above any prompt of the target's context (8k tokens are ~40 kB of text)


def create_app(async_engine: AsyncEngine, model_name: str = "sharpdraft", default_max_tokens: int = 16,
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """Build the app around a started-or-not :class:`AsyncEngine` (the app starts and stops its worker).

    ``max_body_bytes``: larger request bodies are refused with 413 before they are read.
    Raises nothing itself; request errors become OpenAI-style error objects (400 / 404 / 413 / 429 / 500).
    """
    from contextlib import asynccontextmanager

    metrics = ServerMetrics(async_engine, model_name)
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
    serving = OpenAIServing(async_engine, metrics, model_name, default_max_tokens)
    app.include_router(operations_router(async_engine, metrics, model_name))
    app.include_router(completions_router(serving))
    app.include_router(chat_router(serving))
    return app


@contextlib.contextmanager
def serve_in_thread(async_engine: AsyncEngine, model_name: str = "sharpdraft", host: str = "127.0.0.1",
                    port: int = 0, log_level: str = "warning"):
    """A real uvicorn server around ``async_engine`` on its own thread (benchmarks, tests); yields the base URL.
    ``port`` 0 picks a free loopback port.

    Raises:
        RuntimeError: the server did not answer /health within 60 s.
    """
    import socket
    import threading

    import uvicorn

    if port == 0:
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(async_engine, model_name), host=host, port=port,
                                           log_level=log_level))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://{host}:{port}"
    try:
        if not wait_healthy(url, 60):
            raise RuntimeError(f"the server on {url} did not become healthy")
        yield url
    finally:
        server.should_exit = True
        thread.join(10)


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
@click.option("--draft-tokens-by-batch", default=None,
              help="draft tokens per round by the number of running requests, e.g. '1-2:7,3-4:3,5-:0' "
                   "(runtime/draft_length.py; requests that set num_draft_tokens keep theirs)")
@click.option("--adaptive-draft-tokens", is_flag=True,
              help="per request: +2 draft tokens after a fully accepted round, -1 after a rejection")
@prompt_lookup_option(
    "also draft by prompt lookup: a row whose last MIN..MAX tokens occurred before verifies what followed them "
    "instead of the drafter's guess (runtime/prompt_lookup.py); 'off' for the drafter alone",
    default=PROMPT_LOOKUP_DEFAULT)
@draft_confidence_option(DEFAULT_CONFIDENCE)
@thread_pool_option()
def main(engine_dir: Path, host: str, port: int, device: str, backend: str, max_running: int, max_waiting: int,
         model_name: str | None, draft_tokens_by_batch: str | None, adaptive_draft_tokens: bool,
         prompt_lookup: PromptLookup | None, draft_confidence: DraftConfidence | None, thread_pool: str) -> None:
    import uvicorn

    from runtime.engine import SpecEngine
    from runtime.manifest import EngineDirError

    from runtime.draft_length import DraftTokensByBatch

    try:
        table = None if draft_tokens_by_batch is None else DraftTokensByBatch.parse(draft_tokens_by_batch)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--draft-tokens-by-batch") from e
    try:
        if backend == "onnxruntime":
            apply_thread_pool(thread_pool)
        engine = SpecEngine.from_dir(engine_dir, device=device, backend=backend, draft_tokens_by_batch=table,
                                     adaptive_draft_tokens=adaptive_draft_tokens, prompt_lookup=prompt_lookup,
                                     draft_confidence=draft_confidence)
    except (EngineDirError, RuntimeError) as e:
        raise click.ClickException(str(e)) from e
    _ = engine.tokenizer  # load before serving
    app = create_app(AsyncEngine(engine, max_running, max_waiting), model_name or engine_dir.resolve().name)
    uvicorn.run(app, host=host, port=port, log_level="info")


if __name__ == "__main__":
    main()
