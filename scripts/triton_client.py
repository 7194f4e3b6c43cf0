"""Query a sharpdraft Triton model over gRPC streaming with tritonclient; run with .venv-triton's Python.

    .venv-triton/bin/python scripts/triton_client.py --url 127.0.0.1:8001 --prompt "..." [--streaming] [--cancel-after 2]

Prints one JSON object: every response's outputs in order (``responses``), the concatenated text, the final
finish_reason and acceptance figures. With ``--cancel-after K`` the request is cancelled after K responses (the
server must free it; the object then has ``cancelled: true``).
"""
import argparse
import json
import queue

import numpy as np
import tritonclient.grpc as grpcclient

FIELDS = ("finish_reason", "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens",
          "mean_accepted_length", "completion_tokens")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="127.0.0.1:8001")
    ap.add_argument("--model", default="sharpdraft")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--streaming", action="store_true")
    ap.add_argument("--stop", action="append", default=[])
    ap.add_argument("--cancel-after", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300)
    args = ap.parse_args()

    def tensor(name, value, dtype, triton_type):
        t = grpcclient.InferInput(name, [len(value)], triton_type)
        t.set_data_from_numpy(np.array(value, dtype=dtype))
        return t

    inputs = [tensor("text_input", [args.prompt.encode()], np.object_, "BYTES"),
              tensor("streaming", [args.streaming], np.bool_, "BOOL"),
              tensor("sampling_param_max_tokens", [args.max_tokens], np.int32, "INT32"),
              tensor("sampling_param_temperature", [args.temperature], np.float32, "FP32")]
    if args.stop:
        inputs.append(tensor("sampling_param_stop", [s.encode() for s in args.stop], np.object_, "BYTES"))
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(args.url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer(args.model, inputs, request_id="1", enable_empty_final_response=True)
    out = {"responses": [], "text": "", "error": None, "cancelled": False}
    while True:
        result, error = results.get(timeout=args.timeout)
        if error is not None:
            out["error"] = str(error)
            break
        final = result.get_response().parameters["triton_final_response"].bool_param
        if result.as_numpy("text_output") is not None:
            row = {"text_output": result.as_numpy("text_output")[0].decode()}
            for f in FIELDS:
                v = result.as_numpy(f)[0]
                row[f] = v.decode() if isinstance(v, bytes) else v.item()
            out["responses"].append(row)
            out["text"] += row["text_output"]
            out.update({f: row[f] for f in FIELDS})
        if final:
            break
        if args.cancel_after and len(out["responses"]) >= args.cancel_after:
            client.stop_stream(cancel_requests=True)
            out["cancelled"] = True
            break
    if not out["cancelled"]:
        client.stop_stream()
    print(json.dumps(out))
    raise SystemExit(2 if out["error"] else 0)


if __name__ == "__main__":
    main()
