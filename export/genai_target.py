"""Builder target graphs (``--target-precision int4|int8|fp16|bf16``), written by ONNX Runtime GenAI's model builder.

The builder (``python -m onnxruntime_genai.models.builder``, PyPI ``onnxruntime-genai``) writes the graph a CPU
user of SmolLM2 would run anyway: weight-only ``MatMulNBits`` (block 32, symmetric), fused
``GroupQueryAttention`` with rotary inside, ``SkipSimplifiedLayerNormalization``, a quantized tied
embedding (``GatherBlockQuantized``). fp16 targets are the builder's half-precision graph in its CUDA layout
(``-e cuda``: the same fused ``GroupQueryAttention`` and shared past/present buffer, float16 inputs, outputs and KV
cache), the form an ORT GenAI user of a GPU would build, which ONNX Runtime's CPU provider also runs; bf16 is the
same graph in bfloat16, which it does not run (export/bf16.py: validated by emulation, for CUDA / TensorRT
consumers). sharpdraft drives that graph itself (runtime/backends/ort.py, kv_io "shared"); the
builder's ``genai_config.json`` is kept, so ``target/`` also loads in ``onnxruntime_genai.Model``.

Graph contract (kv_io "shared"):
    inputs   input_ids [batch, q_len] int64; attention_mask [batch, total_len] int64 whose row sums are the
             rows' lengths after this call (cached + q_len; ragged rows right-padded with 0);
             past_key_values.{i}.key / .value [batch, kv_heads, capacity, head_dim] f32 (int4 / int8),
             f16 (fp16) or bf16 (bf16)
    outputs  logits [batch, q_len, vocab] and aux_hidden_states [batch, q_len, len(taps) * hidden] (only
             when the drafter reads target features); present.{i}.key / .value bound to the *same* buffers as
             the past (past_present_share_buffer): the graph writes the q_len new positions of row b at
             [sum(mask[b]) - q_len, sum(mask[b])) in place, positions (and rotary) come from the mask sums, so
             rollback is a length change and a decode step copies no cache.

Tap convention: the builder's ``aux_hidden_state_layers`` entry ``i`` is the residual stream *entering* decoder
layer i, i.e. transformers' ``hidden_states[i]``; sharpdraft's taps are ``hidden_states[id + 1]`` (DFlash's
``target_layer_ids``), so the builder is asked for ``id + 1``. Ids whose ``id + 1`` is not in [1, num_layers)
(the last layer's output, which transformers returns after the final norm) cannot be tapped this way.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from runtime.manifest import TARGET_PRECISIONS as PRECISIONS  # fp32 = export/graphs.py's own graph

log = logging.getLogger("sharpdraft.export")

BUILDER_PRECISIONS = ("int4", "int8", "fp16", "bf16")
HALF_PRECISIONS = ("fp16", "bf16")  # bf16: written for CUDA / TensorRT, validated by emulation (export/bf16.py)
# Graphs whose 1-token step must take the block path for speculative output to equal target-only output bit for bit
# (runtime/backends/ort.py OrtTarget.min_q): int4 / int8 at accuracy_level 4 (below), and fp16 by construction: a
# 1-row and a multi-row float16 product may accumulate in another order (SmolLM2 at fp16 on this CPU gave equal
# greedy ids for 4 prompts x 200 tokens either way, which is evidence, not a guarantee; docs/quantized-target.md).
MIN_Q_LEN = {"fp16": 2, "bf16": 2}
# MatMulNBits accuracy_level: 4 = int8 activations (the builder's CPU default, fastest), 0/1 = fp32 compute.
DEFAULT_ACCURACY_LEVEL = 4
BLOCK_SIZE = 32


class GenaiBuildError(RuntimeError):
    """The model builder could not write the quantized target; the message says what to do."""


def builder_taps(tap_ids: list[int], num_layers: int) -> list[int]:
    """Builder ``aux_hidden_state_layers`` for sharpdraft tap ids (``hidden_states[id + 1]``).

    Raises:
        GenaiBuildError: an id whose residual stream the builder cannot expose (``id + 1`` outside [1, L)).
    """
    out = [int(i) + 1 for i in tap_ids]
    bad = [i for i, a in zip(tap_ids, out) if not 1 <= a < num_layers]
    if bad:
        raise GenaiBuildError(f"target layer ids {bad} cannot be tapped from a quantized target graph (the builder "
                              f"exposes the residual stream entering layers 1..{num_layers - 1}, i.e. the outputs "
                              f"of layers 0..{num_layers - 2}); use --target-precision fp32")
    return out


def build_target(hf_dir: Path, out_dir: Path, precision: str, tap_ids: list[int], num_layers: int,
                 accuracy_level: int = DEFAULT_ACCURACY_LEVEL, execution_provider: str = "cpu") -> dict:
    """Run the model builder on a local HF folder; returns the graph's io dict (inputs, outputs, kv_io, facts).

    Args:
        hf_dir: a transformers causal-LM folder (config.json + safetensors).
        out_dir: folder to write ``model.onnx`` (+ ``.data``, ``genai_config.json``) into; created.
        precision: "int4" or "int8" (weight-only MatMulNBits, block 32, symmetric), "fp16" or "bf16" (half
            weights, activations and KV cache; the builder's CUDA layout, see the module docstring).
        tap_ids: sharpdraft tap ids (``hidden_states[id + 1]``); [] = no ``aux_hidden_states`` output.
        accuracy_level: MatMulNBits activation precision (4 = int8, 1 = fp32); int4 / int8 only.
        execution_provider: the builder's ``-e`` for int4 / int8 (half precisions always use "cuda").
    Raises:
        GenaiBuildError: onnxruntime-genai missing, the builder failed (its error line is quoted), or the
            graph lacks an expected input/output.
    """
    if precision not in BUILDER_PRECISIONS:
        raise GenaiBuildError(f"the model builder path writes {', '.join(BUILDER_PRECISIONS)} targets, not "
                              f"{precision!r}")
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError as e:
        raise GenaiBuildError(f"--target-precision {precision} needs onnxruntime-genai (`pip install "
                              "onnxruntime-genai`; scripts/setup.sh installs it) or use --target-precision fp32") from e
    aux = builder_taps(tap_ids, num_layers)
    half = precision in HALF_PRECISIONS
    extra = [] if half else [f"accuracy_level={int(accuracy_level)}"]
    if half:  # the CPU layout of a half graph is unfused attention with concatenated K/V: not the shared contract
        execution_provider = "cuda"
        import onnxruntime as ort

        if "CUDAExecutionProvider" not in ort.get_available_providers():
            # Q/K RMS norms (Qwen3) fused into GroupQueryAttention run on CUDA / WebGPU only: unfused for CPU
            extra.append("fuse_qk_norm_gqa=false")
    if aux:
        extra.append("aux_hidden_state_layers=" + ",".join(map(str, aux)))
    out_dir.mkdir(parents=True, exist_ok=True)
    cache = out_dir.parent / f".{out_dir.name}.builder-cache"
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(out_dir),
           "-p", precision, "-e", execution_provider, "-c", str(cache), "--extra_options", *extra]
    log.info("model builder: %s", " ".join(cmd[2:]))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = _run_child(cmd, env)
    if proc.returncode != 0:
        lines = (proc.stdout + proc.stderr).strip().splitlines() or ["(no output)"]
        cause = next((ln for ln in reversed(lines) if "Error" in ln.split(":")[0]), lines[-1]).strip()
        raise GenaiBuildError(f"the ONNX Runtime GenAI model builder could not build a {precision} graph of "
                              f"{hf_dir} (exit {proc.returncode}: {cause}); use --target-precision fp32 for "
                              "architectures the builder does not support")
    shutil.rmtree(cache, ignore_errors=True)
    return graph_io(out_dir / "model.onnx", num_layers, bool(aux), precision, None if half else accuracy_level,
                    builder_options=extra, execution_provider=execution_provider)


def _run_child(cmd: list[str], env: dict) -> subprocess.CompletedProcess:
    """Run the builder in a process group of its own and wait; if this process is interrupted (Ctrl-C, or SIGTERM /
    SIGHUP through export/cli.py), the whole group is killed before the exception goes on: no builder is left
    running after its export has stopped."""
    import signal

    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate()
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def graph_io(path: Path, num_layers: int, taps: bool, precision: str, accuracy_level: int | None,
             builder_options: list[str], execution_provider: str = "cpu") -> dict:
    """The io entry of a builder graph, checked against the kv_io "shared" contract (module docstring).

    Raises:
        GenaiBuildError: a missing input/output.
    """
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    ins = [i.name for i in m.graph.input]
    outs = [o.name for o in m.graph.output]
    past = [f"past_key_values.{i}.{k}" for i in range(num_layers) for k in ("key", "value")]
    present = [f"present.{i}.{k}" for i in range(num_layers) for k in ("key", "value")]
    want_in = ["input_ids", "attention_mask", *past]
    want_out = ["logits", *(["aux_hidden_states"] if taps else []), *present]
    missing = [n for n in want_in if n not in ins] + [n for n in want_out if n not in outs]
    if missing:
        raise GenaiBuildError(f"{path}: the builder's graph lacks {missing[:4]} (an onnxruntime-genai version "
                              "with another graph contract?); use --target-precision fp32")
    import onnxruntime_genai

    # accuracy_level 4 quantizes activations to int8 per block: a last-bit difference between the 1-token and the
    # multi-token kernels (attention, GEMV vs GEMM) can flip an activation's rounding and then a near-tie argmax,
    # so the runtime runs every call with >= 2 query rows (measured: docs/quantized-target.md)
    builder = {"package": f"onnxruntime-genai {onnxruntime_genai.__version__}", "execution_provider":
               execution_provider, "extra_options": builder_options}
    if accuracy_level is not None:
        builder.update(block_size=BLOCK_SIZE, accuracy_level=int(accuracy_level))
    return {"inputs": want_in, "outputs": want_out, "kv_io": "shared", "precision": precision,
            "min_q_len": MIN_Q_LEN.get(precision, 2 if accuracy_level == 4 else 1),
            "taps_output": "aux_hidden_states" if taps else None, "builder": builder}


def find_shared_weights(target_onnx: Path) -> dict:
    """Embedding and LM head of a builder graph, as specs the runtime dequantizes (runtime/backends/ort.py).

    The int4/int8 tables are ``GatherBlockQuantized`` (embedding on ``input_ids``) and the ``MatMulNBits`` that
    produces ``logits``; their nodes are recorded with their initializer inputs and attributes, so the runtime
    can rebuild each node alone and let ONNX Runtime dequantize (runtime/shared_tables.py).

    Returns:
        ``{"embed_weight": spec, "lm_head_weight": spec}`` with spec ``{"graph": "target", "quantized": {op,
        inputs, attributes}}`` (or ``{"initializer": name}`` for a float table).
    Raises:
        GenaiBuildError: either table cannot be found.
    """
    import onnx

    m = onnx.load(str(target_onnx), load_external_data=False)
    inits = {i.name for i in m.graph.initializer}
    producers = {o: n for n in m.graph.node for o in n.output}

    def source(name: str) -> tuple[str, list[int] | None]:
        """Follow Reshape nodes back to an initializer; returns (initializer, reshape target or None)."""
        n = producers.get(name)
        if n is not None and n.op_type == "Reshape" and n.input[0] in inits:
            shape = next((onnx.numpy_helper.to_array(i).tolist() for i in m.graph.initializer
                          if i.name == n.input[1]), None)
            if shape is None:  # a Constant node
                c = producers.get(n.input[1])
                shape = onnx.numpy_helper.to_array(c.attribute[0].t).tolist() if c is not None else None
            return n.input[0], shape
        return name, None

    def spec(node) -> dict:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        ins = []
        for i, name in enumerate(node.input):
            if i == 1 and node.op_type == "GatherBlockQuantized" or i == 0 and node.op_type == "MatMulNBits":
                ins.append("data")  # the node's data input (indices / activations), fed when dequantizing
                continue
            if not name:
                ins.append(None)  # an optional input the node leaves out
                continue
            init, reshape = source(name)
            if init not in inits:
                raise GenaiBuildError(f"{target_onnx}: {node.op_type} input {name!r} is not a stored tensor")
            ins.append({"initializer": init, "reshape": reshape})
        return {"graph": "target", "quantized": {"op": node.op_type, "inputs": ins, "attributes": attrs}}

    embed = lm_head = None
    for n in m.graph.node:
        if n.op_type == "GatherBlockQuantized" and n.input[1] == "input_ids":
            embed = spec(n)
        elif n.op_type == "Gather" and n.input[1] == "input_ids" and n.input[0] in inits:
            embed = {"graph": "target", "initializer": n.input[0]}
        elif n.op_type == "Gather" and n.input[1] == "input_ids" and n.input[0] in producers:
            t = producers[n.input[0]]  # fp16 builder graphs tie the table as Transpose(lm_head [hidden, vocab])
            if t.op_type == "Transpose" and t.input[0] in inits:
                embed = {"graph": "target", "initializer": t.input[0], "transpose": True}
    node = producers.get("logits")
    while node is not None and node.op_type == "Cast":  # bf16 graphs return their logits cast to fp32
        node = producers.get(node.input[0])
    if node is not None and node.op_type == "MatMulNBits":
        lm_head = spec(node)
    elif node is not None and node.op_type == "MatMul" and node.input[1] in inits:
        lm_head = {"graph": "target", "initializer": node.input[1], "transpose": True}
    if embed is None or lm_head is None:
        raise GenaiBuildError(f"{target_onnx}: cannot find the embedding / LM head tables to share with the drafter")
    return {"embed_weight": embed, "lm_head_weight": lm_head}


def write_note(out_dir: Path, io: dict) -> None:
    """Record how the graph was built beside it (``target/BUILD.json``)."""
    (out_dir / "BUILD.json").write_text(json.dumps({k: io[k] for k in ("precision", "builder")}, indent=1) + "\n")
