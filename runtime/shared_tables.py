"""The target tables a drafter borrows (``manifest.shared_weights``): embedding and LM head, as float32 arrays.

Float graphs store them as initializers in external data: fp32 tables are memory-mapped, never copied (fp16 / bf16
ones are widened to float32 once). Quantized builder
graphs (export/genai_target.py) store them as int4 / int8 blocks; :func:`dequantize` rebuilds the recorded node
alone and lets ONNX Runtime's own kernels dequantize them, so the drafter is fed exactly the values the target
computes with. Tied tables (one quantized tensor for embedding and LM head) are dequantized once per process.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from runtime.manifest import read_initializer
from runtime.ort_threads import session_options

_CACHE: dict = {}


def load_shared_table(target_graph: Path, spec: dict) -> np.ndarray:
    """The ``[vocab, hidden]`` float32 table of one ``shared_weights`` spec of the target graph ``target_graph``.

    Spec forms: ``{"initializer", "transpose"?}`` (memory-mapped; transposed copy when stored ``[hidden, vocab]``)
    or ``{"quantized": {op, inputs, attributes}}`` (:func:`dequantize`, cached while the same tensors are asked for).

    Raises:
        runtime.manifest.EngineDirError: an initializer is missing; ValueError: an unknown quantized op.
    """
    if "quantized" in spec:
        key = (str(target_graph), json.dumps(sorted(i["initializer"] for i in spec["quantized"]["inputs"]
                                                    if isinstance(i, dict))))
        if key not in _CACHE:
            _CACHE.clear()  # one folder's tables at a time
            _CACHE[key] = dequantize(target_graph, spec)
        return _CACHE[key]
    w = read_initializer(target_graph, spec["initializer"])
    if w.dtype != np.float32:  # a half-precision target's table (fp16, or bf16 stored as uint16): one f32 copy
        w = (w.astype(np.uint32) << 16).view(np.float32) if w.dtype == np.uint16 else w.astype(np.float32)
    return np.ascontiguousarray(w.T) if spec.get("transpose") else w


def dequantize(target_onnx: Path, spec: dict) -> np.ndarray:
    """The float32 table ``[vocab, hidden]`` a quantized shared-weight spec (:func:`find_shared_weights`) stands for.

    The recorded node is rebuilt alone over the stored initializers and run by ONNX Runtime: GatherBlockQuantized
    over all row ids (the embedding as the target reads it); MatMulNBits with ``accuracy_level`` 0 over an identity
    matrix (``I @ W^T`` is exact in fp32), transposed. So the drafter sees the same dequantized values the target
    computes with.

    Raises:
        ValueError: an op other than those two.
    """
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper


    q = spec["quantized"]
    op, attrs = q["op"], dict(q["attributes"])
    inits, names = [], []
    for i, inp in enumerate(q["inputs"]):
        if inp is None or inp == "data":
            names.append("x" if inp == "data" else "")
            continue
        arr = np.asarray(read_initializer(target_onnx, inp["initializer"]))
        if inp.get("reshape"):
            arr = arr.reshape(inp["reshape"])
        name = f"w{i}"
        inits.append(onnx.numpy_helper.from_array(np.ascontiguousarray(arr), name))
        names.append(name)
    while names and names[-1] == "":
        names.pop()
    if op == "GatherBlockQuantized":
        vocab = inits[0].dims[0]
        x = np.arange(vocab, dtype=np.int64)
        x_info = helper.make_tensor_value_info("x", TensorProto.INT64, [vocab])
    elif op == "MatMulNBits":
        attrs["accuracy_level"] = 0
        k = int(attrs["K"])
        x = np.eye(k, dtype=np.float32)
        x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, [k, k])
    else:
        raise ValueError(f"cannot dequantize a shared table produced by {op}")
    node = helper.make_node(op, names, ["y"], domain="com.microsoft", **attrs)
    graph = helper.make_graph([node], "dequantize", [x_info], [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                                                                            None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("com.microsoft", 1)])
    sess = ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    (y,) = sess.run(None, {"x": x})
    return np.ascontiguousarray(y if op == "GatherBlockQuantized" else y.T, dtype=np.float32)
