"""The Triton Inference Server Python-backend model that serves an engines/ folder (``1/model.py`` imports it).

Triton's Python backend (triton-inference-server/python_backend README) loads ``TritonPythonModel`` from
``1/model.py``; ``runtime/triton_repo.py`` writes that file and the ``config.pbtxt``. The model is **decoupled**:
``execute`` only queues each request on the continuous-batching worker (runtime/async_engine.py) and returns None;
the worker sends responses through each request's response sender: one per engine step with the new text when
``streaming`` is true, then a final one (``TRITONSERVER_RESPONSE_COMPLETE_FINAL``) with ``finish_reason`` and the
acceptance figures. A request Triton reports cancelled (client gone) is aborted at the next step.

Tensor names follow TensorRT-LLM's ``llmapi`` Triton model: inputs ``text_input``, ``streaming``,
``sampling_param_{max_tokens,temperature,top_p,top_k,seed,stop}``; outputs ``text_output``, ``finish_reason``,
``acceptance_rate``, ``total_accepted_draft_tokens``, ``total_draft_tokens``; plus sharpdraft's ``speculative``
input and ``mean_accepted_length`` / ``completion_tokens`` outputs.
"""
from __future__ import annotations

import json
import logging

import numpy as np

from runtime.sampling import SamplingParams
from runtime.stops import TextDeltas

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 64


def _scalar(request, name: str, pb_utils, default=None):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    arr = tensor.as_numpy().reshape(-1)
    if arr.size == 0:
        return default
    value = arr[0]
    return value.decode("utf-8") if isinstance(value, bytes) else value.item() if hasattr(value, "item") else value


def parse_request(request, pb_utils) -> tuple[str, SamplingParams, bool]:
    """(prompt text, sampling parameters, streaming) from a Triton request.

    Raises:
        ValueError: missing/empty text_input or out-of-range parameters (the message says which).
    """
    text = _scalar(request, "text_input", pb_utils)
    if not isinstance(text, str) or not text:
        raise ValueError("text_input is required: one non-empty UTF-8 string")
    stop_t = pb_utils.get_input_tensor_by_name(request, "sampling_param_stop")
    stop = ()
    if stop_t is not None:
        stop = tuple(s.decode("utf-8") if isinstance(s, bytes) else str(s) for s in stop_t.as_numpy().reshape(-1))
    seed = _scalar(request, "sampling_param_seed", pb_utils)
    try:
        params = _params(request, pb_utils, seed, stop)
    except ValueError as e:  # name the Triton tensors, not the Python fields
        msg = str(e)
        for field in ("max_new_tokens", "temperature", "top_p", "top_k", "seed"):
            msg = msg.replace(field, "sampling_param_" + ("max_tokens" if field == "max_new_tokens" else field), 1) \
                if msg.startswith(field) else msg
        raise ValueError(msg) from e
    return text, params, bool(_scalar(request, "streaming", pb_utils, False))


def _params(request, pb_utils, seed, stop) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=int(_scalar(request, "sampling_param_max_tokens", pb_utils, DEFAULT_MAX_TOKENS)),
        temperature=float(_scalar(request, "sampling_param_temperature", pb_utils, 0.0)),
        top_p=float(_scalar(request, "sampling_param_top_p", pb_utils, 1.0)),
        top_k=int(_scalar(request, "sampling_param_top_k", pb_utils, 0)),
        seed=None if seed is None else int(seed), stop=stop,
        speculative=bool(_scalar(request, "speculative", pb_utils, True)),
        query_scale=bool(_scalar(request, "query_scale", pb_utils, True)))


class TritonPythonModel:
    """Triton Python-backend entry point (see the module docstring)."""

    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils

        from runtime.async_engine import AsyncEngine
        from runtime.engine import SpecEngine

        self.pb = pb_utils
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        device = "cpu" if args.get("model_instance_kind", "CPU") == "CPU" else "auto"
        engine = SpecEngine.from_dir(params["engine_dir"], device=device)
        self.tokenizer = engine.tokenizer
        self.worker = AsyncEngine(engine, int(params.get("max_running", 8)), int(params.get("max_waiting", 64)))
        self.worker.start()

    def _response(self, text: str, finish_reason: str = "", stats=None, completion_tokens: int = 0):
        pb, t = self.pb, []
        t.append(pb.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)))
        t.append(pb.Tensor("finish_reason", np.array([finish_reason.encode("utf-8")], dtype=np.object_)))
        rounds = stats.rounds if stats else 0
        drafted = sum(stats.drafted_per_position) if stats else 0
        accepted = stats.accepted if stats else 0
        t.append(pb.Tensor("acceptance_rate", np.array([accepted / drafted if drafted else 0.0], np.float32)))
        t.append(pb.Tensor("total_accepted_draft_tokens", np.array([accepted], np.int32)))
        t.append(pb.Tensor("total_draft_tokens", np.array([drafted], np.int32)))
        t.append(pb.Tensor("mean_accepted_length", np.array([1 + accepted / rounds if rounds else 0.0],
                                                            np.float32)))
        t.append(pb.Tensor("completion_tokens", np.array([completion_tokens], np.int32)))
        return pb.InferenceResponse(output_tensors=t)

    def execute(self, requests):
        pb = self.pb
        final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        for request in requests:
            sender = request.get_response_sender()
            try:
                text, params, streaming = parse_request(request, pb)
                ids = self.tokenizer.encode(text)
                state: dict = {"stream": None}
                state["stream"] = self.worker.submit(ids, params,
                                                     callback=self._callback(sender, params, streaming, state))
            except Exception as e:  # noqa: BLE001 - bad input or a full queue: answer this request, keep serving
                sender.send(pb.InferenceResponse(error=pb.TritonError(str(e))), flags=final)
        return None

    def _callback(self, sender, params: SamplingParams, streaming: bool, state: dict):
        """The worker-thread callback of one request: streams deltas, sends the final response, aborts when
        Triton reports the request cancelled."""
        pb = self.pb
        final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        deltas = TextDeltas(self.tokenizer, params.stop)
        generated: list[int] = []

        def on_event(event) -> None:
            try:
                if event.error is not None:
                    if event.error == "aborted":  # cancelled by the client: close the response stream
                        sender.send(flags=final)
                    else:
                        sender.send(pb.InferenceResponse(error=pb.TritonError(event.error)), flags=final)
                    return
                generated.extend(event.token_ids)
                result = event.result
                if result is None:
                    if sender.is_cancelled() and state["stream"] is not None:
                        state["stream"].abort()
                        return
                    if streaming:
                        text = deltas.delta(generated)
                        if text:
                            sender.send(self._response(text, completion_tokens=len(generated)))
                    return
                text = deltas.delta(generated, result.text or "") if streaming else (result.text or "")
                sender.send(self._response(text, result.finish_reason, result.stats, len(result.token_ids)),
                            flags=final)
            except Exception:  # noqa: BLE001 - never let one response break the worker
                log.exception("sending a Triton response failed")

        return on_event

    def finalize(self) -> None:
        self.worker.shutdown()
