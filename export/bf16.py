"""bfloat16 graphs (``--dtype bf16``): written for providers with bf16 kernels, checked here by emulation.

Public checkpoints ship in bf16, and GPU deployments (TensorRT strongly-typed networks, ONNX Runtime's CUDA
provider) run them in bf16: its fp32 exponent range means no overflow guard is needed where fp16 needs one.
ONNX Runtime's CPU provider has no bf16 kernels (MatMul, Add, Mul, Softmax all refuse; only Cast, Gather and the
layer norms load), so a bf16 graph cannot run on the machine that exports it. The export therefore:

1. writes the bf16 graphs: the target with ONNX Runtime GenAI's model builder (``-p bf16 -e cuda``), the drafter
   by :func:`to_bf16_drafter` (the fp16 conversion's node choices, export/drafter_quant.py, retyped to bf16 with
   every weight rounded once from its fp32 value);
2. checks each against the ONNX type constraints of its ops (``onnx.checker`` with strict shape inference: a bf16
   input to an op that does not take one fails here);
3. runs an **emulation** (:func:`widen_bf16`): the same graph, node for node, with every bf16 tensor widened to
   fp32, so the stored bf16 weights and the graph's wiring are validated on CPU with the export's usual checks.
   Activation rounding to bf16 (8 significant bits) is not emulated; the manifest says so.

The sharpdraft runtime refuses bf16 engines folders on ONNX Runtime (runtime/backends/ort.py), since its KV buffers
are numpy arrays and numpy has no bf16 type; the folder is for TensorRT / CUDA consumers.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

EMULATION_NOTE = ("bf16 weights and graph wiring checked on ONNX Runtime CPU by an fp32 emulation (every bf16 tensor "
                  "widened to fp32); bf16 activation rounding not emulated")


class Bf16Error(RuntimeError):
    """A graph cannot be written or checked in bf16; the message says what to do."""


def _ir():
    import onnx_ir as ir

    return ir


def _retype(model, old, new, weight) -> dict:
    """In place on an ``onnx_ir`` model: every value, initializer, Cast target and Constant of dtype ``old``
    becomes ``new``; ``weight(name, tensor)`` gives an initializer's new array. Returns counts."""
    ir = _ir()
    counts = {"initializers": 0, "values": 0, "casts": 0, "constants": 0}
    for v in list(model.graph.initializers.values()):
        if v.const_value is not None and v.const_value.dtype == old:
            v.const_value = ir.tensor(weight(v.name, v.const_value), name=v.name)
            counts["initializers"] += 1
        if v.const_value is not None:  # the stored tensor's type is the truth (converters leave stale value_info)
            v.dtype = v.const_value.dtype
    values = list(model.graph.inputs) + [o for n in model.graph.all_nodes() for o in n.outputs]
    for v in values:
        if v.dtype == old:
            v.dtype = new
            counts["values"] += 1
    for n in model.graph.all_nodes():
        if n.op_type == "Cast" and n.attributes["to"].value == old.value:
            n.attributes["to"] = ir.AttrInt64("to", new.value)
            counts["casts"] += 1
        elif n.op_type == "Constant" and "value" in n.attributes and n.attributes["value"].value.dtype == old:
            t = n.attributes["value"].value
            n.attributes["value"] = ir.AttrTensor("value", ir.tensor(weight(t.name, t), name=t.name))
            counts["constants"] += 1
    return counts


def _save(model, dst: Path) -> None:
    ir = _ir()
    dst.parent.mkdir(parents=True, exist_ok=True)
    for old in (dst, dst.with_name(dst.name + ".data")):
        old.unlink(missing_ok=True)
    ir.save(model, dst, external_data=dst.name + ".data")


def to_bf16_drafter(half: Path, fp32: Path, dst: Path) -> dict:
    """Write the bf16 form of a drafter graph to ``dst`` (external data in ``dst.name + '.data'``).

    Args:
        half: the fp16 drafter graph of export/drafter_quant.py ``half_drafter_graph`` (its choice of which nodes
            stay fp32: RMS norms' square-and-mean, DFlash's ``fc``, the rotary angle, the query-scale subgraph).
        fp32: the fp32 graph it was converted from: every bf16 weight is rounded (to nearest even) from its fp32
            value here, never from the fp16 one (fp16 flushes magnitudes below 6e-8 and rounds to 11 bits first).
        dst: output path.
    Returns:
        ``{"method", "dtype", "retyped": counts}``.
    Raises:
        Bf16Error: an fp16 initializer without an fp32 counterpart of the same name and shape.
    """
    import ml_dtypes

    ir = _ir()
    model = ir.load(half)
    source = ir.load(fp32).graph.initializers

    def weight(name, tensor):
        ref = source.get(name)
        if ref is None or ref.const_value is None or tuple(ref.const_value.shape) != tuple(tensor.shape):
            # a constant the converter made (a cast-folded scalar): its fp16 value is all there is
            return tensor.numpy().astype(np.float32).astype(ml_dtypes.bfloat16)
        return ref.const_value.numpy().astype(np.float32).astype(ml_dtypes.bfloat16)

    counts = _retype(model, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, weight)
    if counts["initializers"] == 0:
        raise Bf16Error(f"{half}: no fp16 weight to retype; export with --drafter-precision fp32")
    model.graph.sort()  # the fp16 converter appends its input casts last; the ONNX spec wants topological order
    _save(model, dst)
    return {"method": "bfloat16 (the fp16 conversion's node choices, weights rounded from fp32)",
            "dtype": "bfloat16", "retyped": counts}


def check_types(path: Path) -> None:
    """``onnx.checker`` with strict shape / type inference on the graph at ``path`` (external data not loaded).

    Raises:
        Bf16Error: an op given a type its ONNX schema does not allow (or any other checker failure), quoted.
    """
    import onnx

    try:
        onnx.checker.check_model(str(path), full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        raise Bf16Error(f"{path}: the bf16 graph breaks an ONNX schema ({str(e).strip().splitlines()[0][:300]}); "
                        "export --dtype fp16 instead") from e


def widen_bf16(src: Path, dst: Path) -> dict:
    """Write the fp32 emulation of the bf16 graph ``src`` to ``dst``: the same nodes, every bf16 value, weight,
    Cast target and Constant made fp32 (exact: bf16 is fp32's top 16 bits). ONNX Runtime's CPU provider runs it.

    Returns:
        the retype counts ``{"initializers", "values", "casts", "constants"}``.
    Raises:
        Bf16Error: ``src`` holds no bf16 tensor.
    """
    ir = _ir()
    model = ir.load(src)
    counts = _retype(model, ir.DataType.BFLOAT16, ir.DataType.FLOAT,
                     lambda _, t: t.numpy().astype(np.float32))
    if counts["initializers"] + counts["values"] == 0:
        raise Bf16Error(f"{src} holds no bf16 tensor to widen")
    _save(model, dst)
    return counts
