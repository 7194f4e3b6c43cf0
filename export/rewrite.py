"""Insert SharpDraft's in-graph query scale beta(N) (arXiv 2610.05106) in front of every drafter attention.

Pipeline (each step's output feeds the next; rules are independent of each other, so their order is free):
1. collect: every rule's ``pattern`` + ``check`` over the graph's nodes; queries already fed by a tagged
   ``Mul`` count as ``already_scaled`` (idempotency), the rest are to do.
2. group: attentions whose N is the same symbolic or static dim (or the very same key values) share one beta
   subgraph (see ``_group``); in ``num_keys_from="score_mask"`` mode, attentions reading the same mask value(s).
3. rewrite: per group, N -> beta (``export/rules/beta_graph.py``); per attention, ``Mul`` on the query.
4. ``graph.sort()`` and record the profile in ``metadata_props["sharpdraft.query_scale"]``.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import onnx
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass, TopologicalSortPass

from export.rules import DecomposedAttentionQueryScale, GroupQueryAttentionQueryScale, OnnxAttentionQueryScale
from export.rules.base import AttentionMatch, MatchFailure, is_query_scale_mul
from export.rules.beta_graph import NameTable, SharedBeta, SubgraphBuilder, beta_from_num_keys
from export.rules.decomposed import ScoreMask, score_masks, visible_keys_from_masks
from plugins.rule import QueryScaleProfile, Vocabulary

logger = logging.getLogger(__name__)

PROFILE_METADATA_KEY = "sharpdraft.query_scale"
RULES = (DecomposedAttentionQueryScale(), OnnxAttentionQueryScale(), GroupQueryAttentionQueryScale())
RULES_BY_NAME = {rule.name: rule for rule in RULES}


class QueryScaleRewriteError(RuntimeError):
    """The query-scale rewrite cannot proceed (no attention found, or a conflicting earlier rewrite)."""


@dataclasses.dataclass(slots=True)
class _Collected:
    todo: list[AttentionMatch] = dataclasses.field(default_factory=list)
    already: list[AttentionMatch] = dataclasses.field(default_factory=list)
    rejected: list[tuple[str, str, MatchFailure]] = dataclasses.field(default_factory=list)  # (rule, node, why)


class NumKeysFrom(Vocabulary):
    """Where the in-graph beta reads N (see :func:`insert_query_scale`). A ``str`` enum: equal to its value."""

    KEY_LENGTH = "key_length"  # one N per graph: a Shape of the keys (single-sequence graphs)
    KEY_MASK = "key_mask"  # per batch row: the sum of a [batch, keys] key-mask input (DFlash blocks)
    SCORE_MASK = "score_mask"  # per query row: the keys each attention's own score mask shows (causal drafters)


NUM_KEYS_FROM = tuple(NumKeysFrom)
MODE_METADATA_KEY = "sharpdraft.query_scale.num_keys_from"


def insert_query_scale(model: ir.Model, profile: QueryScaleProfile, num_keys_input: str | None = None,
                       row_switch_input: str | None = None, *, num_keys_from: str | None = None) -> dict[str, int]:
    """Multiply the query of every attention in ``model.graph`` by beta(N), N computed in-graph at run time.

    Each query Q (e.g. [batch, heads, q_len, head_dim], any float dtype) becomes ``Q * Cast(beta(N), Q.dtype)``.
    Where N comes from (``num_keys_from``; default ``"key_mask"`` when ``num_keys_input`` is given, else
    ``"key_length"``):

    - ``"key_length"``: N is read with ``Shape`` from the attention's keys (never folded); see ``export/rules/``
      for the attention forms matched (decomposed, ONNX ``Attention`` (per row when causal), ORT
      ``GroupQueryAttention``). Attentions over the same key dim share one beta subgraph. Right for DFlash (every
      query of a block sees all keys).
    - ``"key_mask"``: ``num_keys_input`` names a graph input ``[batch, keys]`` holding a 0/1 key mask (e.g. a ragged
      batch's right-padded ``attention_mask``); N is counted per batch row, ``ReduceSum(mask, -1)``, shaped
      ``[batch, 1, ..., 1]`` to the query's rank, so padded rows get the beta of their own visible keys. All
      attentions share that one subgraph (every query of a DFlash block sees the same N).
    - ``"score_mask"`` (causal drafters: PARD, EAGLE-3): N is counted **per query row** from each decomposed
      attention's own mask, found in its score chain ``MatMul(Q, K^T) -> [Mul/Div] -> Add(M) | Where(c, S, fill)
      -> Softmax``: visible = ``Greater(M, t)`` for an additive float mask (t = max(-1e30, finfo(M.dtype).min / 2);
      HF uses finfo.min or -inf for hidden keys, 0 for visible ones; an ``M = Where(c, 0, finfo.min)`` is read as
      ``c`` directly), ``c`` for ``Where(c, scores, fill)``, ``Not(c)`` for ``Where(c, fill, scores)``, And-ed when
      the chain has several masks. ``N = ReduceSum(Cast(visible, float32), axes=[-1], keepdims=1)``, e.g.
      ``[batch, 1, q_len, 1]`` for a ``[batch, 1, q_len, keys]`` mask, broadcast onto Q. Row i of sequence b thus
      gets beta(N[b, i]), holes (padding) excluded. Attentions reading the very same mask value(s) share one N/beta
      subgraph (HF exports one mask for all full-attention layers). Sliding-window layers read their own
      (windowed) mask, so their N is min(visible, W) per layer: the per-layer window cap falls out for free.

    With ``row_switch_input`` (modes ``"key_mask"`` and ``"score_mask"``), a new float32 graph input ``[batch]`` of
    that name turns the scale on (1) or off (0) per batch row: beta_row = 1 + (beta - 1) * switch[b] (per-request
    A/B comparisons in one batch). With ``profile.enabled == False`` nothing is inserted (frozen baseline); the
    profile is recorded either way in ``model.metadata_props["sharpdraft.query_scale"]`` (JSON of
    ``profile.to_dict()``) and the mode in ``metadata_props["sharpdraft.query_scale.num_keys_from"]``. Modifies
    ``model`` in place.

    Returns:
        ``{rule name: attentions scaled, "beta_subgraphs": n, "already_scaled": n}``. Idempotent: on an
        already-rewritten model the rule counts and ``beta_subgraphs`` are 0 and ``already_scaled`` counts the
        attentions found scaled (tagged ``Mul`` on their query).

    Raises:
        ValueError: unknown ``num_keys_from``; ``num_keys_input`` missing for ``"key_mask"`` or given for another
            mode; ``row_switch_input`` with ``"key_length"``.
        QueryScaleRewriteError: the profile is enabled and no attention was found (message lists the candidates
            rejected and why); or the model is already scaled under a different (or unrecorded) profile or another
            recorded mode; or ``num_keys_input`` is not a graph input, or a query's rank is unknown where the
            per-row beta needs it; or, in ``"score_mask"`` mode, an attention has no mask in its score chain
            (e.g. ``is_causal`` SDPA exported without a mask) or is an ONNX ``Attention`` / ``GroupQueryAttention``
            node (no silent fallback to a single N).
    """
    mode = _resolve_mode(num_keys_from, num_keys_input, row_switch_input)
    graph = model.graph
    graph.sort()  # _group relies on topological order (NOTE Acyclic-Source)
    found = _collect(graph)
    _check_recorded_profile(model, profile, found.already, mode)
    counts = {rule.name: 0 for rule in RULES} | {"beta_subgraphs": 0, "already_scaled": len(found.already)}
    if profile.enabled:
        if not found.todo and not found.already:
            raise QueryScaleRewriteError(_no_attention_message(graph, found.rejected))
        if mode == "key_length":
            _rewrite(graph, found.todo, profile, counts)
        elif mode == "key_mask" and found.todo:
            _rewrite_from_key_mask(graph, found.todo, profile, counts, num_keys_input, row_switch_input)
        elif mode == "score_mask" and found.todo:
            _rewrite_from_score_mask(graph, found.todo, profile, counts, row_switch_input)
        graph.sort()
    model.metadata_props[PROFILE_METADATA_KEY] = _profile_json(profile)
    model.metadata_props[MODE_METADATA_KEY] = mode
    for rule_name, node_name, why in found.rejected:
        logger.debug("query scale: %s skipped %r: %s", rule_name, node_name, why)
    logger.info("query scale (%s, N from %s): %s", "enabled" if profile.enabled else "disabled", mode, counts)
    return counts


def rewrite_file(src: Path, dst: Path, profile: QueryScaleProfile, num_keys_input: str | None = None,
                 row_switch_input: str | None = None, *, num_keys_from: str | None = None) -> dict[str, int]:
    """Load ``src`` (with its external data), :func:`insert_query_scale`, clean up, toposort, save and check.

    The result is ``dst`` with all initializers in ``dst.parent / (dst.name + ".data")``; ``onnx.checker`` runs on
    the saved file. ``src == dst`` is allowed (the data file is replaced atomically). ``num_keys_input``,
    ``row_switch_input`` and ``num_keys_from`` are passed on (see :func:`insert_query_scale`).

    Returns:
        the counts of :func:`insert_query_scale`.

    Raises:
        ValueError, QueryScaleRewriteError: see :func:`insert_query_scale`.
        onnx.checker.ValidationError: the saved model is not valid ONNX.
    """
    src, dst = Path(src), Path(dst)
    model = ir.load(src)
    counts = insert_query_scale(model, profile, num_keys_input, row_switch_input, num_keys_from=num_keys_from)
    RemoveUnusedNodesPass()(model)
    TopologicalSortPass()(model)
    dst.parent.mkdir(parents=True, exist_ok=True)
    ir.save(model, dst, external_data=dst.name + ".data")
    onnx.checker.check_model(str(dst))
    return counts


def remove_query_scale(model: ir.Model) -> int:
    """Undo :func:`insert_query_scale`: every tagged query ``Mul`` is bypassed (its users read the query again),
    and the beta subgraphs, now unused, are removed; graph inputs (the row switch) stay declared. The result is
    the frozen drafter, for A/B timing of the query-scale node (scripts/bench_speed.py) or to ship without it.

    Returns:
        the number of ``Mul`` nodes removed (0 for a graph that was never rewritten).
    """
    removed = 0
    for node in list(model.graph):
        if not is_query_scale_mul(node):
            continue
        query = node.inputs[0]
        ir.convenience.replace_all_uses_with(node.outputs[0], query)
        for i, out in enumerate(model.graph.outputs):
            if out is node.outputs[0]:
                model.graph.outputs[i] = query
        model.graph.remove(node, safe=True)
        removed += 1
    RemoveUnusedNodesPass()(model)
    model.metadata_props.pop(PROFILE_METADATA_KEY, None)
    model.metadata_props.pop(MODE_METADATA_KEY, None)
    return removed


def _resolve_mode(num_keys_from: str | None, num_keys_input: str | None, row_switch_input: str | None) -> str:
    mode = num_keys_from if num_keys_from is not None else ("key_mask" if num_keys_input is not None else "key_length")
    if mode not in NUM_KEYS_FROM:
        raise ValueError(f"num_keys_from must be one of {', '.join(m.value for m in NumKeysFrom)}, got "
                         f"{num_keys_from!r}")
    mode = NumKeysFrom(mode).value
    if mode == "key_mask" and num_keys_input is None:
        raise ValueError("num_keys_from='key_mask' needs num_keys_input (the [batch, keys] key-mask input's name)")
    if mode != "key_mask" and num_keys_input is not None:
        raise ValueError(f"num_keys_input is only used with num_keys_from='key_mask', not {mode!r}")
    if mode == "key_length" and row_switch_input is not None:
        raise ValueError("row_switch_input needs a per-row N: use num_keys_from='key_mask' or 'score_mask'")
    return mode


def _collect(graph: ir.Graph) -> _Collected:
    """Run every rule's pattern + check over the top-level nodes (subgraphs of If/Loop are not visited)."""
    found, seen = _Collected(), set()
    for node in graph:
        for rule in RULES:
            match = rule.pattern(node)
            if match is None:
                continue
            failure = rule.check(match)
            if failure is not None:
                found.rejected.append((rule.name, node.name or node.op_type, failure))
                continue
            site = (id(match.anchor), match.query_index)
            if site in seen:  # e.g. two Softmax reading the same scores: scale that query once
                continue
            seen.add(site)
            (found.already if is_query_scale_mul(match.query.producer()) else found.todo).append(match)
    return found


def _rewrite(graph: ir.Graph, todo: list[AttentionMatch], profile: QueryScaleProfile, counts: dict[str, int]) -> None:
    names = NameTable(graph)
    for g, group in enumerate(_group(graph, todo)):
        source = group[0]
        beta_builder = SubgraphBuilder(graph, names, f"beta{g}")
        num_keys = RULES_BY_NAME[source.rule].num_keys(source, beta_builder)
        shared = SharedBeta(beta_builder, beta_from_num_keys(beta_builder, num_keys, profile))
        for match in group:
            site_builder = SubgraphBuilder(graph, names, f"beta{g}/site")
            RULES_BY_NAME[match.rule].rewrite(match, shared, site_builder)
            site_builder.insert_before(match.anchor)
            counts[match.rule] += 1
        beta_builder.insert_before(source.anchor)  # graph.sort() afterwards puts everything in order
        counts["beta_subgraphs"] += 1


def _rewrite_from_key_mask(graph: ir.Graph, todo: list[AttentionMatch], profile: QueryScaleProfile,
                           counts: dict[str, int], mask_name: str, switch_name: str | None = None) -> None:
    """One beta subgraph from N[b] = sum(mask[b, :]) (int64), shaped per query rank; see :func:`insert_query_scale`."""
    import numpy as np

    mask = next((v for v in graph.inputs if v.name == mask_name), None)
    if mask is None:
        raise QueryScaleRewriteError(f"num_keys_input {mask_name!r} is not an input of graph {graph.name!r} "
                                     f"(inputs: {[v.name for v in graph.inputs]})")
    ranks = {len(m.query.shape) if m.query.shape is not None else None for m in todo}
    if None in ranks:
        raise QueryScaleRewriteError("a query's rank is unknown: cannot shape the per-row N from the key mask")
    names = NameTable(graph)
    first = next(iter(graph))
    builder = SubgraphBuilder(graph, names, "beta_rows")
    as_int = builder.op("Cast", mask, to=int(ir.DataType.INT64))
    per_row = builder.op("ReduceSum", as_int, builder.const(np.array([-1], dtype=np.int64)), keepdims=0)  # [batch]
    switch = None
    if switch_name is not None:
        if any(v.name == switch_name for v in graph.inputs):
            raise QueryScaleRewriteError(f"graph already has an input named {switch_name!r}")
        batch = mask.shape[0] if mask.shape is not None else None
        switch = ir.Value(name=switch_name, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([batch]))
        graph.inputs.append(switch)
    shared_by_rank = {}
    for rank in sorted(ranks):
        axes = builder.const(np.arange(1, rank, dtype=np.int64))
        n = builder.op("Unsqueeze", per_row, axes)  # [batch, 1, ...]
        beta = beta_from_num_keys(builder, n, profile)
        if switch is not None:  # 1 + (beta - 1) * switch[b]
            one = builder.const(np.array(1.0, dtype=np.float32))
            on = builder.op("Unsqueeze", switch, axes)
            beta = builder.op("Add", builder.op("Mul", builder.op("Sub", beta, one), on), one)
        shared_by_rank[rank] = SharedBeta(builder, beta)
    for match in todo:
        site_builder = SubgraphBuilder(graph, names, "beta_rows/site")
        RULES_BY_NAME[match.rule].rewrite(match, shared_by_rank[len(match.query.shape)], site_builder)
        site_builder.insert_before(match.anchor)
        counts[match.rule] += 1
    builder.insert_before(first)
    counts["beta_subgraphs"] += len(shared_by_rank)


def _rewrite_from_score_mask(graph: ir.Graph, todo: list[AttentionMatch], profile: QueryScaleProfile,
                             counts: dict[str, int], switch_name: str | None) -> None:
    """Per-query-row N from each attention's own score mask; see :func:`insert_query_scale` (``"score_mask"``)."""
    import numpy as np

    groups: dict[tuple, list[tuple[AttentionMatch, list[ScoreMask]]]] = {}
    problems = []
    for match in todo:
        if match.rule != DecomposedAttentionQueryScale.name:
            problems.append(f"  {match.anchor.op_type} node {match.anchor.name!r} ({match.rule}): "
                            "per-row N from the score mask needs the decomposed MatMul/Softmax form")
            continue
        masks = score_masks(match)
        if isinstance(masks, MatchFailure):
            problems.append(f"  attention at {match.anchor.name!r}: {masks}")
            continue
        groups.setdefault(tuple(m.key for m in masks), []).append((match, masks))
    if problems:
        raise QueryScaleRewriteError(
            "num_keys_from='score_mask' cannot count the visible keys of every attention:\n" + "\n".join(problems)
            + "\nExport the causal drafter with an explicit attention mask in a decomposed attention (e.g. "
            "attn_implementation='sdpa' or 'eager' given a 2-D attention_mask, opset < 23, so the graph has "
            "MatMul -> Add(mask) / Where(mask) -> Softmax), or use num_keys_from='key_length' (non-causal drafters "
            "such as DFlash) or 'key_mask'.")
    switch = None
    if switch_name is not None:
        if any(v.name == switch_name for v in graph.inputs):
            raise QueryScaleRewriteError(f"graph already has an input named {switch_name!r}")
        ranks = {len(m.query.shape) if m.query.shape is not None else None for m, _ in sum(groups.values(), [])}
        if None in ranks:
            raise QueryScaleRewriteError("a query's rank is unknown: cannot shape the per-row switch to it")
        first_query = next(iter(groups.values()))[0][0].query
        batch = first_query.shape[0] if first_query.shape is not None else None
        switch = ir.Value(name=switch_name, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([batch]))
        graph.inputs.append(switch)
    names = NameTable(graph)
    for g, members in enumerate(groups.values()):
        builder = SubgraphBuilder(graph, names, f"beta_mask{g}")
        beta = beta_from_num_keys(builder, visible_keys_from_masks(builder, members[0][1]), profile)
        shared_by_rank: dict[int | None, SharedBeta] = {}
        for match, _ in members:
            rank = len(match.query.shape) if switch is not None else None
            if rank not in shared_by_rank:
                if switch is None:
                    shared_by_rank[rank] = SharedBeta(builder, beta)
                else:  # 1 + (beta - 1) * switch[b], switch shaped [batch, 1, ..., 1] to the query's rank
                    one = builder.const(np.array(1.0, dtype=np.float32))
                    on = builder.op("Unsqueeze", switch, builder.const(np.arange(1, rank, dtype=np.int64)))
                    shared_by_rank[rank] = SharedBeta(builder, builder.op(
                        "Add", builder.op("Mul", builder.op("Sub", beta, one), on), one))
            site_builder = SubgraphBuilder(graph, names, f"beta_mask{g}/site")
            RULES_BY_NAME[match.rule].rewrite(match, shared_by_rank[rank], site_builder)
            site_builder.insert_before(match.anchor)
            counts[match.rule] += 1
        builder.insert_before(members[0][0].anchor)  # graph.sort() afterwards puts everything in order
        counts["beta_subgraphs"] += 1


def _group(graph: ir.Graph, matches: list[AttentionMatch]) -> list[list[AttentionMatch]]:
    """Split matches into groups sharing one N; the first match of each group is its source.

    Matches with equal ``group_key`` share the N computed from the source: the match whose key values are
    produced first. NOTE(sharpdraft): Acyclic-Source. The graph is toposorted, so every member's key values, hence
    its anchor, come after the source's key values; the source's N therefore never depends on a member's Mul.
    Example: keys ("keys", ("sym", "s0 + 8")) x2 and ("keys", ("static", 9)) -> [[m0, m1], [m2]].
    """
    order = {node: i for i, node in enumerate(graph)}

    def position(match: AttentionMatch) -> int:  # where the last key value it reads is produced
        return max((order.get(v.producer(), -1) for v in match.key_sources), default=-1)

    buckets: dict[object, list[AttentionMatch]] = {}
    for k, match in enumerate(matches):
        key = match.group_key if match.group_key is not None else ("own", k)
        buckets.setdefault(key, []).append(match)
    return [sorted(members, key=position) for members in buckets.values()]


def _profile_json(profile: QueryScaleProfile) -> str:
    return json.dumps(profile.to_dict(), sort_keys=True)


def _check_recorded_profile(model: ir.Model, profile: QueryScaleProfile, already: list[AttentionMatch],
                            mode: str) -> None:
    if not already:
        return
    recorded_mode = model.metadata_props.get(MODE_METADATA_KEY)
    if recorded_mode is not None and recorded_mode != mode:
        raise QueryScaleRewriteError(
            f"{len(already)} attention(s) are already query-scaled with N from {recorded_mode!r}, not the requested "
            f"{mode!r}; rewrite the unscaled export instead")
    recorded = model.metadata_props.get(PROFILE_METADATA_KEY)
    if recorded is None or json.loads(recorded) != profile.to_dict():
        raise QueryScaleRewriteError(
            f"{len(already)} attention(s) are already query-scaled under profile {recorded or '<not recorded>'}, "
            f"which differs from the requested {_profile_json(profile)}; rewrite the unscaled export instead")


def _no_attention_message(graph: ir.Graph, rejected: list[tuple[str, str, MatchFailure]]) -> str:
    ops = sorted({node.op_type for node in graph})
    lines = [f"no attention to scale in graph {graph.name!r} (ops: {', '.join(ops)})"]
    lines += [f"  {rule} rejected {node!r}: {why}" for rule, node, why in rejected]
    if not rejected:
        lines.append("  no Softmax fed by a MatMul(Q, K^T) and no ONNX Attention node was found")
    return "\n".join(lines)
