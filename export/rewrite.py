"""Insert SharpDraft's in-graph query scale beta(N) (arXiv 2610.05106) in front of every drafter attention.

Pipeline (each step's output feeds the next; rules are independent of each other, so their order is free):
1. collect: every rule's ``pattern`` + ``check`` over the graph's nodes; queries already fed by a tagged
   ``Mul`` count as ``already_scaled`` (idempotency), the rest are to do.
2. group: attentions whose N is the same symbolic or static dim (or the very same key values) share one beta
   subgraph (see ``_group``).
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
from plugins.rule import QueryScaleProfile

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


def insert_query_scale(model: ir.Model, profile: QueryScaleProfile, num_keys_input: str | None = None,
                       row_switch_input: str | None = None) -> dict[str, int]:
    """Multiply the query of every attention in ``model.graph`` by beta(N), computed in-graph from the key length.

    Each query Q (e.g. [batch, heads, q_len, head_dim], any float dtype) becomes ``Q * Cast(beta(N), Q.dtype)``;
    N is read at run time with ``Shape`` (never folded). See ``export/rules/`` for the attention forms matched.
    With ``num_keys_input`` (the name of a graph input ``[batch, keys]`` holding a 0/1 key mask, e.g. a ragged
    batch's right-padded ``attention_mask``), N is instead counted per batch row: ``ReduceSum(mask, -1)``, shaped
    ``[batch, 1, ..., 1]`` to the query's rank, so padded rows get the beta of their own visible keys. All
    attentions then share that one subgraph (every query of a DFlash block sees the same N). With
    ``row_switch_input`` too, a new float32 graph input ``[batch]`` of that name turns the scale on (1) or off (0)
    per row: beta_row = 1 + (beta - 1) * switch (per-request A/B comparisons in one batch).
    With ``profile.enabled == False`` nothing is inserted (frozen baseline); the profile is recorded either way in
    ``model.metadata_props["sharpdraft.query_scale"]`` (JSON of ``profile.to_dict()``). Modifies ``model`` in place.

    Returns:
        ``{rule name: attentions scaled, "beta_subgraphs": n, "already_scaled": n}``. Idempotent: on an
        already-rewritten model the rule counts and ``beta_subgraphs`` are 0 and ``already_scaled`` counts the
        attentions found scaled.

    Raises:
        QueryScaleRewriteError: the profile is enabled and no attention was found (message lists the candidates
            rejected and why); or the model is already scaled under a different (or unrecorded) profile; or
            ``num_keys_input`` is not a graph input, or a query's rank is unknown.
    """
    graph = model.graph
    graph.sort()  # _group relies on topological order (NOTE Acyclic-Source)
    found = _collect(graph)
    _check_recorded_profile(model, profile, found.already)
    counts = {rule.name: 0 for rule in RULES} | {"beta_subgraphs": 0, "already_scaled": len(found.already)}
    if profile.enabled:
        if not found.todo and not found.already:
            raise QueryScaleRewriteError(_no_attention_message(graph, found.rejected))
        if num_keys_input is None:
            _rewrite(graph, found.todo, profile, counts)
        elif found.todo:
            _rewrite_from_key_mask(graph, found.todo, profile, counts, num_keys_input, row_switch_input)
        graph.sort()
    model.metadata_props[PROFILE_METADATA_KEY] = _profile_json(profile)
    for rule_name, node_name, why in found.rejected:
        logger.debug("query scale: %s skipped %r: %s", rule_name, node_name, why)
    logger.info("query scale (%s): %s", "enabled" if profile.enabled else "disabled", counts)
    return counts


def rewrite_file(src: Path, dst: Path, profile: QueryScaleProfile, num_keys_input: str | None = None,
                 row_switch_input: str | None = None) -> dict[str, int]:
    """Load ``src`` (with its external data), :func:`insert_query_scale`, clean up, toposort, save and check.

    The result is ``dst`` with all initializers in ``dst.parent / (dst.name + ".data")``; ``onnx.checker`` runs on
    the saved file. ``src == dst`` is allowed (the data file is replaced atomically).

    Returns:
        the counts of :func:`insert_query_scale`.

    Raises:
        QueryScaleRewriteError: see :func:`insert_query_scale`.
        onnx.checker.ValidationError: the saved model is not valid ONNX.
    """
    src, dst = Path(src), Path(dst)
    model = ir.load(src)
    counts = insert_query_scale(model, profile, num_keys_input, row_switch_input)
    RemoveUnusedNodesPass()(model)
    TopologicalSortPass()(model)
    dst.parent.mkdir(parents=True, exist_ok=True)
    ir.save(model, dst, external_data=dst.name + ".data")
    onnx.checker.check_model(str(dst))
    return counts


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


def _check_recorded_profile(model: ir.Model, profile: QueryScaleProfile, already: list[AttentionMatch]) -> None:
    if not already:
        return
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
