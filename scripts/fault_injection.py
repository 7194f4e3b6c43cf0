"""Fault injection against a running sharpdraft server (loopback only, bounded in time).

Sends, concurrently and in a seeded random order: good requests (streaming and not, greedy, their texts checked
against solo target-only runs given by the caller), clients that hang up at random points (non-streaming: a read
timeout of 50-600 ms; streaming: after 0-3 chunks), malformed JSON, oversized bodies, invalid sampling
parameters, and a burst beyond the server's running + waiting capacity (429 with Retry-After, then dropped). An
optional ``arm_engine_error`` callback makes the next engine step fail (a server-side hook the caller owns), so an
engine error hits a batch mid-generation. Afterwards the server must drain to zero running / waiting requests and
answer a normal request with the expected text.

    python scripts/fault_injection.py --url http://127.0.0.1:8000 --requests 60 --seed 0

Returns / prints a JSON report: requests sent by kind, responses by status, mismatched texts, whether the server
drained, and the final request's check. tests/runtime/test_faults.py runs it against a tiny server and also counts
engine-side leaks (sequences, pending admissions, streams, threads).
"""
from __future__ import annotations

import asyncio
import collections
import json
import random
import time
from typing import Callable

import click
import httpx

PROMPTS = ["def add(a, b):", "Once upon a time", "The capital of France is", "import os\n\ndef main():"]
KINDS = ("ok", "ok-stream", "hangup", "hangup-stream", "malformed", "oversized", "bad-params")


async def _one(client: httpx.AsyncClient, kind: str, rng: random.Random, expected: dict[str, str],
               report: dict) -> None:
    url = "/v1/completions"
    prompt = rng.choice(PROMPTS)
    greedy = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
    report["sent"][kind] += 1
    try:
        if kind == "ok":
            r = await client.post(url, json=greedy)
            report["status"][r.status_code] += 1
            if r.status_code == 200 and expected and r.json()["choices"][0]["text"] != expected[prompt]:
                report["mismatched"] += 1
        elif kind == "ok-stream":
            text = ""
            async with client.stream("POST", url, json={**greedy, "stream": True}) as r:
                report["status"][r.status_code] += 1
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = json.loads(line[6:])
                        if "choices" in chunk and chunk["choices"]:
                            text += chunk["choices"][0]["text"]
            if r.status_code == 200 and expected and text != expected[prompt]:
                report["mismatched"] += 1
        elif kind == "hangup":
            try:
                await client.post(url, json={**greedy, "max_tokens": 2000, "ignore_eos": True},
                                  timeout=httpx.Timeout(30, read=rng.uniform(0.05, 0.6)))
                report["status"]["finished before hang-up"] += 1
            except httpx.ReadTimeout:
                report["status"]["hung up"] += 1
        elif kind == "hangup-stream":
            chunks = rng.randint(0, 3)
            async with client.stream("POST", url, json={**greedy, "max_tokens": 2000, "ignore_eos": True,
                                                        "stream": True}) as r:
                report["status"][r.status_code] += 1
                seen = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        seen += 1
                        if seen > chunks:
                            break  # leaving the block closes the connection
        elif kind == "malformed":
            r = await client.post(url, content=b'{"prompt": "x", "max_tokens": ', headers={"content-type":
                                                                                           "application/json"})
            report["status"][r.status_code] += 1
        elif kind == "oversized":
            r = await client.post(url, json={"prompt": "x" * (5 << 20), "max_tokens": 1})
            report["status"][r.status_code] += 1
        elif kind == "bad-params":
            r = await client.post(url, json={**greedy, "temperature": -1})
            report["status"][r.status_code] += 1
    except httpx.HTTPError as e:
        report["client_errors"][type(e).__name__] += 1


async def _burst(client: httpx.AsyncClient, capacity: int, report: dict) -> None:
    """capacity + 4 long requests at once: the excess is refused with 429 + Retry-After; all are then dropped."""
    async def long(i):
        try:
            r = await client.post("/v1/completions", json={"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 2000,
                                                            "ignore_eos": True, "temperature": 0},
                                  timeout=httpx.Timeout(30, read=1.5))
            report["burst"][r.status_code] += 1
            if r.status_code == 429 and "retry-after" not in r.headers:
                report["burst"]["429 without Retry-After"] += 1
        except httpx.ReadTimeout:
            report["burst"]["admitted, then hung up"] += 1

    await asyncio.gather(*(long(i) for i in range(capacity + 4)))


async def run_faults(url: str, requests: int = 60, seed: int = 0, expected: dict[str, str] | None = None,
                     capacity: int | None = None, arm_engine_error: Callable[[], None] | None = None,
                     concurrency: int = 6, drain_timeout_s: float = 30.0) -> dict:
    """Run the fault mix against ``url`` (module docstring); returns the report.

    Args:
        expected: prompt -> greedy text of 12 tokens from a solo target-only run (checked for "ok" kinds).
        capacity: the server's max_running + max_waiting (burst size); None reads it from /health.
        arm_engine_error: called once, a third of the way through, to make the next engine step raise.
    """
    rng = random.Random(seed)
    report = {"sent": collections.Counter(), "status": collections.Counter(), "burst": collections.Counter(),
              "client_errors": collections.Counter(), "mismatched": 0}
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        health = (await client.get("/health")).json()
        cap = capacity or health["max_running"] + health["max_waiting"]
        kinds = [rng.choice(KINDS) for _ in range(requests)]
        sem = asyncio.Semaphore(concurrency)

        async def guarded(i, kind):
            async with sem:
                if arm_engine_error is not None and i == requests // 3:
                    arm_engine_error()
                    report["sent"]["engine error armed"] += 1
                await _one(client, kind, random.Random(seed * 1000 + i), expected or {}, report)

        await asyncio.gather(*(guarded(i, k) for i, k in enumerate(kinds)))
        await _burst(client, cap, report)
        deadline = time.monotonic() + drain_timeout_s
        while time.monotonic() < deadline:
            h = (await client.get("/health")).json()
            if h["running"] == 0 and h["waiting"] == 0:
                break
            await asyncio.sleep(0.05)
        report["drained"] = h["running"] == 0 and h["waiting"] == 0
        final = await client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0})
        report["final_status"] = final.status_code
        report["final_equal"] = bool(expected) and final.status_code == 200 and \
            final.json()["choices"][0]["text"] == expected[PROMPTS[0]]
        report["metrics_aborted"] = sum(float(line.rsplit(" ", 1)[1]) for line in (await client.get("/metrics")).text
                                        .splitlines() if line.startswith("sharpdraft_requests_aborted_total{"))
    report["seconds"] = round(time.monotonic() - t0, 2)
    return {k: dict(v) if isinstance(v, collections.Counter) else v for k, v in report.items()}


@click.command()
@click.option("--url", default="http://127.0.0.1:8000", show_default=True)
@click.option("--requests", default=60, show_default=True, type=click.IntRange(1, 10_000))
@click.option("--seed", default=0, show_default=True)
@click.option("--expected", type=click.Path(exists=True, dir_okay=False), default=None,
              help="JSON {prompt: greedy 12-token text} from solo runs, to check outputs")
def main(url: str, requests: int, seed: int, expected: str | None) -> None:
    """Fault mix against a running server (loopback); prints the JSON report."""
    exp = json.loads(open(expected).read()) if expected else None
    print(json.dumps(asyncio.run(run_faults(url, requests, seed, exp)), indent=1))


if __name__ == "__main__":
    main()
