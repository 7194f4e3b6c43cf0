"""Lower-precision drafter graphs: ``--drafter-precision int8`` (weight-only ``MatMulNBits`` layers and the target's
own quantized LM-head rows) and ``fp16`` (:func:`half_drafter_graph`).

Why: on a CPU a drafter call is memory-bound. The demo DFlash drafter reads 32 MB of fp32 layer weights and, for
its LM head, 19 MB of float rows (the target's tied table over the 8,192-id draft vocabulary, fed at run time and
transposed by ONNX Runtime on every call): 5-7 ms per call at 1k context, a quarter of a verify round
(docs/quantized-target.md, "Drafter quantization"). This pass rewrites the exported (already query-scaled) drafter
graph:

1. every MatMul whose weight is a stored tensor (q/k/v/o, MLP, DFlash's ``fc``) becomes ``MatMulNBits``, 8-bit,
   block 32, symmetric, by ONNX Runtime's own ``MatMulNBitsQuantizer`` (the int4 form loses proposals:
   docs/quantized-target.md);
2. when the target is a quantized builder graph (export/genai_target.py), the LM head the graph read as the input
   ``lm_head_weight`` becomes a ``MatMulNBits`` over the target's **own** quantized rows (the draft vocabulary's
   rows of its tied table, or all of them), bit for bit the weights the target scores with; the input is removed,
   so the runtime feeds nothing. With a float target the LM head stays a runtime input.

Attention score/value MatMuls (both inputs computed) and the query-scale (beta) nodes are not touched, so the
in-graph rule is the same. ``accuracy_level`` 4 (int8 activations, the builder's CPU setting) is what makes
``MatMulNBits`` fast on CPU; the drafter's logits then differ slightly from the float graph's, which changes which
tokens are drafted, never which are accepted (the target verifies every draft token). The export measures how
often the quantized graph proposes the float graph's tokens (:func:`proposal_agreement`) and refuses below
:data:`MIN_SLOT1_AGREEMENT`.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

DRAFTER_PRECISIONS = ("fp32", "fp16", "bf16", "int8")  # bf16: export/bf16.py
# fp16: the numerically sensitive parts stay float32 (inputs cast up, outputs cast down): the RMS norms'
# square-and-mean (x^2 of a residual stream overflows float16's 65504), DFlash's ``fc`` (a sum over every tapped
# target layer), the rotary angle and the query-scale subgraph (log of the key count, a per-row scalar)
HALF_BLOCKED_OPS = ("Pow", "ReduceMean", "Sqrt", "Reciprocal")
QUERY_SCALE_PREFIX = "sharpdraft/"
LAYER_BITS = 8
BLOCK_SIZE = 32
ACCURACY_LEVEL = 4  # int8 activations: the fast CPU path of MatMulNBits
MIN_SLOT1_AGREEMENT = 0.85  # quantized vs float graph, slot 1 argmax on real text (measured 0.95-0.99)
LM_HEAD_INPUT = "lm_head_weight"
HEAD_NODE = "draft_head"


class DrafterQuantError(RuntimeError):
    """The drafter graph cannot be quantized as asked; the message says what to do."""


def quantize_drafter_graph(src: Path, dst: Path, lm_head_spec: dict | None, target_onnx: Path | None,
                           head_rows: np.ndarray | None, layer_bits: int = LAYER_BITS) -> dict:
    """Write the int8 form of the drafter graph ``src`` to ``dst`` (external data in ``dst.name + '.data'``).

    Args:
        src: the exported, rewritten fp32 drafter graph (``drafter/model.onnx``).
        dst: where to write the quantized graph (``src`` may be replaced by passing the same path).
        lm_head_spec: the manifest's ``shared_weights.lm_head_weight`` spec of the target
            (export/genai_target.py ``find_shared_weights``); a ``quantized`` ``MatMulNBits`` spec moves the LM
            head into the graph, anything else (a float target) leaves it a runtime input.
        target_onnx: the target graph holding that spec's tensors.
        head_rows: int64 ``[draft_vocab]`` target ids whose LM-head rows the graph scores (the draft vocabulary, in
            the runtime's order); None = every row.
        layer_bits: 8 (the export's choice) or 4 (kept for the A/B in scripts/bench_settings.py).
    Returns:
        the graph entry's ``quantization`` record: ``{"method", "bits", "block_size", "accuracy_level",
        "quantized_matmuls", "lm_head"}`` with ``lm_head`` ``{"source": "target", "bits", "rows"}`` or None.
    Raises:
        DrafterQuantError: no stored MatMul weight to quantize, or a quantized LM-head spec of a form this pass does
        not know (asymmetric / zero points), each with what to pass instead.
    """
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    model = onnx.load(str(src))
    q = MatMulNBitsQuantizer(model, algo_config=DefaultWeightOnlyQuantConfig(
        block_size=BLOCK_SIZE, is_symmetric=True, accuracy_level=ACCURACY_LEVEL, bits=layer_bits))
    q.process()
    model = q.model.model
    n_q = sum(1 for n in model.graph.node if n.op_type == "MatMulNBits")
    if n_q == 0:
        raise DrafterQuantError(f"{src}: no MatMul with a stored weight to quantize; export with "
                                "--drafter-precision fp32")
    head = None
    quantized_head = (lm_head_spec or {}).get("quantized")
    if quantized_head is not None and any(i.name == LM_HEAD_INPUT for i in model.graph.input):
        head = _bake_lm_head(model, quantized_head, target_onnx, head_rows)
    dst.parent.mkdir(parents=True, exist_ok=True)
    for old in (dst, dst.with_name(dst.name + ".data")):
        old.unlink(missing_ok=True)
    onnx.save(model, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
              location=dst.name + ".data", size_threshold=1024)
    return {"method": "MatMulNBits (onnxruntime.quantization.MatMulNBitsQuantizer)", "bits": layer_bits,
            "block_size": BLOCK_SIZE, "accuracy_level": ACCURACY_LEVEL, "quantized_matmuls": n_q, "lm_head": head}


def half_drafter_graph(src: Path, dst: Path) -> dict:
    """Write the float16 form of the drafter graph ``src`` to ``dst`` (external data in ``dst.name + '.data'``).

    ONNX Runtime's own converter (``onnxruntime.transformers.float16.convert_float_to_float16``) with
    ``keep_io_types``: inputs and outputs stay float32 (the runtime's feeds, the K/V buffers and the LM-head rows
    it passes are unchanged; casts at the graph's edges), weights and the attention/MLP math become float16, and the
    nodes of :data:`HALF_BLOCKED_OPS`, DFlash's ``fc`` (the MatMul on ``target_hidden``), the rotary angle
    (:func:`_rotary_angle_nodes`) and the query-scale subgraph stay float32.

    Memory-bounded: the converter decides on the graph with its external tensors left on disk (empty stand-ins of
    the same names); their values are then converted one tensor at a time from a memory map of ``src``'s data file
    (the converter's own rounding, ``convert_np_to_float16``), so a 1 B-parameter drafter converts in well under
    its own size of extra memory.

    Returns:
        the graph entry's ``quantization`` record: ``{"method", "dtype", "kept_float32": {ops, nodes}}``.
    Raises:
        DrafterQuantError: the graph has no MatMul with a stored weight (nothing to convert), or the converter
            made a tensor of its own from a stored one (not written by this conversion; please report it).
    """
    import onnx
    from onnx import TensorProto
    from onnxruntime.transformers.float16 import convert_float_to_float16, convert_np_to_float16

    src, dst = Path(src), Path(dst)
    model = onnx.load(str(src), load_external_data=False)
    inits = {i.name for i in model.graph.initializer}
    if not any(n.op_type == "MatMul" and n.input[1] in inits for n in model.graph.node):
        raise DrafterQuantError(f"{src}: no MatMul with a stored weight; export with --drafter-precision fp32")
    stored = {}  # name -> (dims, external_data, data_type) of the tensors left on disk
    for t in model.graph.initializer:
        if t.data_location == TensorProto.EXTERNAL:
            stored[t.name] = (list(t.dims), {e.key: e.value for e in t.external_data}, t.data_type)
            del t.external_data[:]
            t.data_location = TensorProto.DEFAULT
            del t.dims[:]
            t.dims.append(0)  # an empty stand-in: the converter only retypes it
    keep = [n.name for n in model.graph.node if n.name.startswith(QUERY_SCALE_PREFIX)
            or (n.op_type == "MatMul" and "target_hidden" in n.input)] + _rotary_angle_nodes(model)
    half = convert_float_to_float16(model, keep_io_types=True, op_block_list=list(HALF_BLOCKED_OPS),
                                    node_block_list=keep, disable_shape_infer=True)
    _drop_round_trips(half)
    dst.parent.mkdir(parents=True, exist_ok=True)
    data = dst.with_name(dst.name + ".data")
    for old in (dst, data):
        old.unlink(missing_ok=True)
    with open(data, "wb") as out:
        for t in half.graph.initializer:
            if t.name not in stored:
                if list(t.dims) == [0] and not t.raw_data:
                    raise DrafterQuantError(f"internal error: the float16 converter made {t.name!r} from a stored "
                                            "tensor; export with --drafter-precision fp32 and please report it")
                continue
            dims, ext, old_type = stored[t.name]
            values = np.memmap(src.parent / ext["location"], dtype=onnx.helper.tensor_dtype_to_np_dtype(old_type),
                               mode="r", offset=int(ext.get("offset", 0)), shape=tuple(dims))
            if old_type == TensorProto.FLOAT and t.data_type == TensorProto.FLOAT16:
                values = convert_np_to_float16(values)
            offset = out.tell()
            out.write(np.ascontiguousarray(values).tobytes())
            del values
            del t.dims[:]
            t.dims.extend(dims)
            t.data_location = TensorProto.EXTERNAL
            for key, value in (("location", data.name), ("offset", str(offset)),
                               ("length", str(out.tell() - offset))):
                t.external_data.add(key=key, value=value)
    for vi in half.graph.value_info:  # the converter typed the stand-ins' value infos with their empty shape
        if vi.name in stored:
            del vi.type.tensor_type.shape.dim[:]
            for d in stored[vi.name][0]:
                vi.type.tensor_type.shape.dim.add(dim_value=d)
    onnx.save(half, str(dst))
    return {"method": "float16 (onnxruntime.transformers.float16, keep_io_types)", "dtype": "float16",
            "kept_float32": {"ops": list(HALF_BLOCKED_OPS), "nodes": len(keep)}}


def _rotary_angle_nodes(model) -> list[str]:
    """Names of the nodes that turn ``position_ids`` into the rotary ``Cos`` / ``Sin`` (those two included).

    In float16 the angle ``position * inv_freq`` is off by up to half its spacing, 0.5 rad at position 1,024 and
    1 rad at 2,048, which scrambles RoPE; so the angle and its cos / sin stay float32 and only their values in
    [-1, 1] are cast down (as engines keep a float16 cos / sin cache).
    """
    producers = {o: n for n in model.graph.node for o in n.output}
    downstream, frontier = set(), ["position_ids"]
    users = _users(model)
    while frontier:  # forward from position_ids, not past Cos / Sin
        for n in users.get(frontier.pop(), []):
            if n.name not in downstream:
                downstream.add(n.name)
                if n.op_type not in ("Cos", "Sin"):
                    frontier.extend(n.output)
    upstream, stack = set(), [n for n in model.graph.node if n.op_type in ("Cos", "Sin")]
    while stack:  # backward from Cos / Sin
        n = stack.pop()
        if n.name in upstream:
            continue
        upstream.add(n.name)
        stack.extend(producers[i] for i in n.input if i in producers)
    return sorted(downstream & upstream)


def _drop_round_trips(model) -> int:
    """Remove float32 -> float16 -> float32 round trips between two float32 nodes (in place); returns how many.

    The converter casts every blocked node's output down and the next blocked node's input up again, so a chain of
    blocked nodes (an RMS norm's ``Pow -> ReduceMean -> Add -> Sqrt``) would still hold ``x^2`` in float16, where it
    overflows; here a ``Cast(to=float16)`` read only by ``Cast(to=float32)`` nodes is bypassed.
    """
    from onnx import TensorProto

    def cast_to(n):
        return next((a.i for a in n.attribute if a.name == "to"), None) if n.op_type == "Cast" else None

    users = _users(model)
    graph_outputs = {o.name for o in model.graph.output}
    dropped = []
    for down in model.graph.node:
        ups = users.get(down.output[0], []) if cast_to(down) == TensorProto.FLOAT16 else []
        if (not ups or down.output[0] in graph_outputs or any(cast_to(u) != TensorProto.FLOAT for u in ups)
                or any(u.output[0] in graph_outputs for u in ups)):
            continue
        for up in ups:  # readers of the up-cast read the float32 source instead
            for reader in users.get(up.output[0], []):
                for j, name in enumerate(reader.input):
                    if name == up.output[0]:
                        reader.input[j] = down.input[0]
            dropped.append(up)
        dropped.append(down)
    gone = {id(n) for n in dropped}
    keep = [n for n in model.graph.node if id(n) not in gone]
    del model.graph.node[:]
    model.graph.node.extend(keep)
    return len(dropped)


def _users(model) -> dict[str, list]:
    """Tensor name -> the nodes that read it."""
    users: dict[str, list] = {}
    for n in model.graph.node:
        for i in n.input:
            users.setdefault(i, []).append(n)
    return users


def _bake_lm_head(model, spec: dict, target_onnx: Path, rows: np.ndarray | None) -> dict:
    """Replace ``MatMul(x, Transpose(lm_head_weight))`` by ``MatMulNBits`` over the target's quantized rows."""
    from onnx import helper, numpy_helper

    from runtime.manifest import read_initializer

    attrs = spec["attributes"]
    ins = spec["inputs"]
    if spec["op"] != "MatMulNBits" or len(ins) != 3 or not all(isinstance(i, dict) for i in ins[1:]):
        raise DrafterQuantError(f"the target's LM head is a {spec['op']} with {len(ins)} inputs (zero points?); "
                                "this pass takes symmetric MatMulNBits only: export with --drafter-precision fp32")
    packed = np.asarray(read_initializer(target_onnx, ins[1]["initializer"]))
    scales = np.asarray(read_initializer(target_onnx, ins[2]["initializer"]))
    n, k = int(attrs["N"]), int(attrs["K"])
    packed = packed.reshape(n, -1, packed.shape[-1]) if packed.ndim != 3 else packed
    scales = scales.reshape(n, -1)
    if rows is not None:
        packed, scales = packed[rows], scales[rows]
    users = {}
    for node in model.graph.node:
        for name in node.input:
            users.setdefault(name, []).append(node)
    transposes = [t for t in users.get(LM_HEAD_INPUT, []) if t.op_type == "Transpose"]
    matmuls = [m for t in transposes for m in users.get(t.output[0], []) if m.op_type == "MatMul"]
    if len(users.get(LM_HEAD_INPUT, [])) != 1 or len(transposes) != 1 or len(matmuls) != 1:
        raise DrafterQuantError("the drafter graph does not read lm_head_weight as one MatMul(x, Transpose(W)); "
                                "export with --drafter-precision fp32")
    tr, mm = transposes[0], matmuls[0]
    node = helper.make_node("MatMulNBits", [mm.input[0], f"{HEAD_NODE}.weight_q", f"{HEAD_NODE}.scales"],
                            list(mm.output), name=HEAD_NODE, domain="com.microsoft", K=k, N=int(packed.shape[0]),
                            bits=int(attrs["bits"]), block_size=int(attrs["block_size"]),
                            accuracy_level=ACCURACY_LEVEL)
    nodes = list(model.graph.node)
    at = nodes.index(mm)
    nodes[at] = node
    nodes.remove(tr)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    model.graph.initializer.extend([numpy_helper.from_array(np.ascontiguousarray(packed), f"{HEAD_NODE}.weight_q"),
                                    numpy_helper.from_array(np.ascontiguousarray(scales), f"{HEAD_NODE}.scales")])
    keep = [i for i in model.graph.input if i.name != LM_HEAD_INPUT]
    del model.graph.input[:]
    model.graph.input.extend(keep)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return {"source": "target", "bits": int(attrs["bits"]), "block_size": int(attrs["block_size"]),
            "rows": int(packed.shape[0])}


def proposal_agreement(float_graph: Path, quant_graph: Path, feeds) -> dict:
    """How often the quantized drafter graph drafts the float graph's tokens, on batched feeds.

    Args:
        float_graph / quant_graph: the two drafter graphs (same io, except that the quantized one may lack
            ``lm_head_weight``).
        feeds: one feed of the float graph whose first output is ``logits [batch, slots, vocab]`` f32, or a
            function returning an iterable of such feeds (row chunks: it is called once per graph and each chunk is
            made when it is run, so one chunk's target features and activations are in memory at a time; a 1 B
            drafter's 48-row feed carries 2.5 GB of features).
    Returns:
        ``{"slot_top1_agreement": [per slot], "rows": batch (all chunks), "chunks": int, "max_abs_diff_logits":
        float, "max_abs_logit": float}``.
    Raises:
        export.checks.ValidationError: NaN in either graph's logits, or an inf where the float graph's are
            finite (:func:`export.checks.max_abs_diff`).
    """
    from export import checks
    from export.checks import max_abs_diff

    make = (lambda: [feeds]) if isinstance(feeds, dict) else feeds
    ref: list[np.ndarray] = []  # the float graph's logits per chunk: [chunk, slots, vocab] f32
    agree, diff, peak, rows = None, 0.0, 0.0, 0
    for name, path in (("float", float_graph), ("quant", quant_graph)):
        sess = checks.session(path)
        names = {i.name for i in sess.get_inputs()}
        out = sess.get_outputs()[0].name
        for c, feed in enumerate(make()):
            logits = sess.run([out], {k: v for k, v in feed.items() if k in names})[0]
            if name == "float":
                ref.append(logits)
                continue
            a = ref[c]
            ref[c] = None  # freed as the comparison goes
            same = (a.argmax(-1) == logits.argmax(-1)).sum(0)
            agree = same if agree is None else agree + same
            diff = max(diff, max_abs_diff(logits, a, f"quantized drafter graph {quant_graph} logits"))
            peak = max(peak, float(np.abs(a).max()))
            rows += int(a.shape[0])
        del sess  # one session at a time (a 1 B drafter's fp32 graph is 4 GB)
    if not rows:
        raise ValueError("proposal_agreement: the feeds are empty")
    return {"slot_top1_agreement": [round(float(x) / rows, 4) for x in agree], "rows": rows, "chunks": len(ref),
            "max_abs_diff_logits": diff, "max_abs_logit": peak}
