"""Prometheus metrics of the server (prometheus-client, one registry per app).

Speculative figures follow runtime/metrics.py's definitions: MAL = 1 + accepted draft tokens / speculative rounds
(bonus included), acceptance at draft position j = accepted / rounds that drafted position j. They are summed over
finished requests (aborted requests are counted in requests_total only).

Beside sharpdraft's own series, the same facts under vLLM's names (its V1 engine, ``model_name`` label), so the
dashboards and benchmark tools written for vLLM read them: ``vllm:spec_decode_num_drafts`` (rounds that drafted),
``vllm:spec_decode_num_draft_tokens`` (draft tokens verified), ``vllm:spec_decode_num_accepted_tokens``,
``vllm:spec_decode_num_accepted_tokens_per_pos`` (label ``position``, 0-based: the first draft token is position 0),
counters exposed with the ``_total`` suffix, so MAL = 1 + accepted / drafts as vLLM's tools compute it; and
``vllm:num_requests_running`` / ``_waiting``, ``vllm:prompt_tokens`` / ``vllm:generation_tokens``,
``vllm:request_success`` (label ``finished_reason``), ``vllm:time_to_first_token_seconds`` and
``vllm:e2e_request_latency_seconds``. vLLM counts per engine step; sharpdraft counts a request's rounds when it
finishes, so in-flight requests appear once they end.
"""
from __future__ import annotations

import threading

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)

disable_created_metrics()  # no *_created series beside every counter and histogram (halves the page, as vLLM)

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160)
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5)


class ServerMetrics:
    """All metrics of one server; ``render()`` gives the text exposition."""

    def __init__(self, async_engine, model_name: str = "sharpdraft") -> None:
        r = self.registry = CollectorRegistry()
        p = "sharpdraft_"
        self.requests = Counter(p + "requests", "API responses by endpoint and HTTP status (streams count their 200)",
                                ["endpoint", "status"], registry=r)
        self.aborted = Counter(p + "requests_aborted", "Requests aborted because the client went away",
                               ["endpoint"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated (usage.completion_tokens)",
                                         registry=r)
        self.rounds = Counter(p + "spec_rounds", "Speculative rounds (draft + verify) of finished requests",
                              registry=r)
        self.accepted = Counter(p + "spec_accepted_draft_tokens", "Accepted draft tokens", registry=r)
        self.pos_accepted = Counter(p + "spec_accepted_at_position", "Accepted draft tokens per draft position "
                                    "(1 = the first draft token; vLLM's per_pos series counts from 0)",
                                    ["position"], registry=r)
        self.pos_drafted = Counter(p + "spec_drafted_at_position", "Rounds that drafted each draft position "
                                   "(1 = the first draft token)", ["position"], registry=r)
        self._lock = threading.Lock()
        self._rounds = 0
        self._accepted = 0
        mal = Gauge(p + "spec_mean_accepted_length", "Mean accepted length (bonus included) over finished requests",
                    registry=r)
        mal.set_function(lambda: 1.0 + self._accepted / self._rounds if self._rounds else 0.0)
        self.latency = Histogram(p + "request_latency_seconds", "Submit to last token", ["endpoint"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Submit to first token", ["endpoint"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.draft_s = Histogram(p + "request_draft_seconds", "Drafting time per request (steps it was part of)",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.verify_s = Histogram(p + "request_verify_seconds", "Verify time per request (steps it was part of)",
                                  buckets=LATENCY_BUCKETS, registry=r)
        self.step_s = Histogram(p + "engine_step_seconds", "Wall time of one engine step (all running rows)",
                                buckets=STEP_BUCKETS, registry=r)
        self.step_rows = Histogram(p + "engine_step_rows", "Sequences advanced by one engine step",
                                   buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32), registry=r)
        running = Gauge(p + "requests_running", "Sequences in the engine batch", registry=r)
        running.set_function(lambda: async_engine.num_running)
        waiting = Gauge(p + "requests_waiting", "Requests queued for a batch slot (queue depth)", registry=r)
        waiting.set_function(lambda: async_engine.num_waiting)
        self.model_name = model_name
        v, m = "vllm:", ["model_name"]
        self.v_drafts = Counter(v + "spec_decode_num_drafts", "Number of spec decoding drafts.", m, registry=r)
        self.v_draft_tokens = Counter(v + "spec_decode_num_draft_tokens", "Number of draft tokens.", m, registry=r)
        self.v_accepted = Counter(v + "spec_decode_num_accepted_tokens", "Number of accepted tokens.", m, registry=r)
        self.v_pos = Counter(v + "spec_decode_num_accepted_tokens_per_pos",
                             "Accepted tokens per draft position.", [*m, "position"], registry=r)
        self.v_prompt = Counter(v + "prompt_tokens", "Number of prefill tokens processed.", m, registry=r)
        self.v_generation = Counter(v + "generation_tokens", "Number of generation tokens processed.", m, registry=r)
        self.v_success = Counter(v + "request_success", "Count of successfully processed requests.",
                                 [*m, "finished_reason"], registry=r)
        self.v_ttft = Histogram(v + "time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                                m, buckets=LATENCY_BUCKETS, registry=r)
        self.v_e2e = Histogram(v + "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                               m, buckets=LATENCY_BUCKETS, registry=r)
        v_running = Gauge(v + "num_requests_running", "Number of requests in model execution batches.", m,
                          registry=r)
        v_running.labels(model_name).set_function(lambda: async_engine.num_running)
        v_waiting = Gauge(v + "num_requests_waiting", "Number of requests waiting to be processed.", m, registry=r)
        v_waiting.labels(model_name).set_function(lambda: async_engine.num_waiting)

    def on_step(self, outputs: list, seconds: float) -> None:
        self.step_s.observe(seconds)
        self.step_rows.observe(len(outputs))

    def request_done(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def request_finished(self, endpoint: str, stream, result, prompt_tokens: int) -> None:
        import time

        now = time.perf_counter()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(len(result.token_ids))
        s = result.stats
        self.rounds.inc(s.rounds)
        self.accepted.inc(s.accepted)
        with self._lock:
            self._rounds += s.rounds
            self._accepted += s.accepted
        for j, (a, d) in enumerate(zip(s.accepted_per_position, s.drafted_per_position), start=1):
            self.pos_accepted.labels(str(j)).inc(a)
            self.pos_drafted.labels(str(j)).inc(d)
        m = self.model_name
        self.v_drafts.labels(m).inc(s.rounds)
        self.v_draft_tokens.labels(m).inc(sum(s.drafted_per_position))
        self.v_accepted.labels(m).inc(s.accepted)
        for j, a in enumerate(s.accepted_per_position):
            self.v_pos.labels(m, str(j)).inc(a)
        self.v_prompt.labels(m).inc(prompt_tokens)
        self.v_generation.labels(m).inc(len(result.token_ids))
        self.v_success.labels(m, result.finish_reason).inc()
        self.latency.labels(endpoint).observe(now - stream.submitted)
        self.v_e2e.labels(m).observe(now - stream.submitted)
        if stream.first_token_at is not None:
            self.ttft.labels(endpoint).observe(stream.first_token_at - stream.submitted)
            self.v_ttft.labels(m).observe(stream.first_token_at - stream.submitted)
        self.draft_s.observe(s.draft_s)
        self.verify_s.observe(s.verify_s)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
