"""``sharpdraft::QueryScaledAttention`` for ONNX Runtime on CPU, implemented by the torch reference.

Used to validate a fused drafter graph (export/fuse.py) against the portable one: the very node TensorRT's parser
maps to the plugin (plugins/tensorrt_plugin.py) runs here as an onnxruntime-extensions Python custom op calling
:func:`plugins.attention_ref.attention_ref`. onnxruntime-extensions serves Python ops under its own domain
(``ai.onnx.contrib``), so :func:`session` loads a copy of the model with the node's domain renamed; the file on disk
keeps ``sharpdraft``.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

EXTENSIONS_DOMAIN = "ai.onnx.contrib"
_registered = False


def register() -> None:
    """Register the Python op with onnxruntime-extensions (once per process).

    Raises:
        ImportError: onnxruntime-extensions is missing (``pip install onnxruntime-extensions``).
    """
    global _registered
    if _registered:
        return
    import torch
    from onnxruntime_extensions import PyCustomOpDef, onnx_op

    from plugins.attention_ref import OP_TYPE, attention_ref
    from plugins.rule import QueryScaleProfile

    f, i32, i64 = PyCustomOpDef.dt_float, PyCustomOpDef.dt_int32, PyCustomOpDef.dt_int64
    attrs = {"ref_keys": i64, "top_k": i64, "slope": f, "cap": f, "enabled": i64, "causal": i64, "window": i64,
             "scale": f}

    @onnx_op(op_type=OP_TYPE, inputs=[f, f, f, i32, i32], outputs=[f], attrs=attrs)
    def _query_scaled_attention(q, k, v, kv_lens, key_mask, **a):
        profile = QueryScaleProfile(ref_keys=int(a["ref_keys"]), top_k=int(a["top_k"]), slope=float(a["slope"]),
                                    cap=float(a["cap"]), enabled=bool(a["enabled"]))
        out = attention_ref(torch.from_numpy(np.ascontiguousarray(q)), torch.from_numpy(np.ascontiguousarray(k)),
                            torch.from_numpy(np.ascontiguousarray(v)), torch.from_numpy(np.asarray(kv_lens)),
                            profile, bool(a["causal"]), int(a["window"]) or None, float(a["scale"]) or None,
                            torch.from_numpy(np.asarray(key_mask)))
        return out.numpy()

    _registered = True


def session(path: str | Path, threads: int | None = None):
    """An ``onnxruntime.InferenceSession`` of the fused graph at ``path`` with the node run by the torch reference.

    Raises:
        ImportError: onnxruntime-extensions is missing.
        onnxruntime errors: the graph is invalid.
    """
    import onnx
    import onnxruntime as ort
    from onnxruntime_extensions import get_library_path

    from plugins.attention_ref import DOMAIN

    register()
    model = onnx.load(str(path))  # with external data
    for node in model.graph.node:
        if node.domain == DOMAIN:
            node.domain = EXTENSIONS_DOMAIN
    kept = [o for o in model.opset_import if o.domain != DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(kept + [onnx.helper.make_opsetid(EXTENSIONS_DOMAIN, 1)])
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
    so.register_custom_ops_library(get_library_path())
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
