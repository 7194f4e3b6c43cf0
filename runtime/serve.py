"""OpenAI-compatible HTTP server over an engines/ folder (FastAPI + uvicorn; 127.0.0.1 by default).

    python -m runtime.serve --engine engines/ [--host 127.0.0.1] [--port 8000]

Endpoints: POST /v1/completions (non-streaming; greedy or sampled: temperature, top_p, top_k, seed, stop),
GET /v1/models, GET /health. Requests run one at a time on the engine (a lock); concurrency, streaming and chat
arrive with the serving issue.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import click
from fastapi import FastAPI, HTTPException
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from runtime.sampling import SamplingParams


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    seed: int | None = Field(None, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None  # vLLM extension
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    logprobs: int | None = None
    stream: bool = False
    echo: bool = False

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


def create_app(engine, model_name: str = "sharpdraft") -> FastAPI:
    """Build the FastAPI app around a :class:`runtime.engine.SpecEngine` (or anything with its interface)."""
    app = FastAPI(title="sharpdraft", version="0.1.0")
    lock = asyncio.Lock()

    @app.exception_handler(RequestValidationError)
    async def bad_request(_, exc: RequestValidationError) -> JSONResponse:
        # OpenAI answers malformed requests with 400 and an error object, not FastAPI's 422.
        msg = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors())
        return JSONResponse({"error": {"message": msg, "type": "invalid_request_error"}}, status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_, exc: HTTPException) -> JSONResponse:
        return JSONResponse({"error": {"message": exc.detail, "type": "invalid_request_error"}},
                            status_code=exc.status_code)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "sharpdraft"}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> JSONResponse:
        if req.model not in (None, model_name):
            raise HTTPException(404, f"model {req.model!r} does not exist; this server serves {model_name!r}")
        unsupported = [name for name, bad in (("stream=true", req.stream),
                                              ("logprobs", req.logprobs is not None), ("n > 1", req.n > 1)) if bad]
        if unsupported:
            raise HTTPException(400, f"{', '.join(unsupported)}: not supported yet; remove it from the request")
        ids = engine.tokenizer.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
        if not ids:
            raise HTTPException(400, "prompt encodes to zero tokens; give a non-empty prompt")
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        try:
            params = SamplingParams(max_new_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                                    top_k=req.top_k, seed=req.seed, stop=stop, ignore_eos=req.ignore_eos,
                                    stop_token_ids=tuple(req.stop_token_ids or ()))
        except ValueError as e:
            raise HTTPException(400, str(e)) from e
        async with lock:
            try:
                result = await asyncio.to_thread(engine.generate, ids, params=params)
            except ValueError as e:
                raise HTTPException(400, str(e)) from e
        out = result.token_ids
        text = result.text
        if req.echo:
            text = engine.tokenizer.decode(ids) + text
        body: dict[str, Any] = {
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": req.model or model_name,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": result.finish_reason}],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out),
                      "total_tokens": len(ids) + len(out)},
            "sharpdraft": result.stats.to_dict(),
        }
        return JSONResponse(body)

    return app


@click.command()
@click.option("--engine", "engine_dir", default="engines", type=click.Path(path_type=Path), show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True)
@click.option("--device", default="auto", type=click.Choice(["auto", "cpu", "cuda"]))
def main(engine_dir: Path, host: str, port: int, device: str) -> None:
    import uvicorn

    from runtime.engine import SpecEngine
    from runtime.manifest import EngineDirError

    try:
        engine = SpecEngine.from_dir(engine_dir, device=device)
    except (EngineDirError, RuntimeError) as e:
        raise click.ClickException(str(e)) from e
    uvicorn.run(create_app(engine, model_name=engine_dir.resolve().name), host=host, port=port, log_level="info")


if __name__ == "__main__":
    main()
