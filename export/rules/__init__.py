"""Graph rules of the SharpDraft query-scale rewrite (one rule per attention form); see ``export/rewrite.py``."""
from export.rules.base import AttentionMatch, MatchFailure, fail, is_query_scale_mul
from export.rules.decomposed import (DecomposedAttentionQueryScale, ScoreMask, score_masks,
                                     visible_keys_from_masks)
from export.rules.gqa import GroupQueryAttentionQueryScale
from export.rules.onnx_attention import OnnxAttentionQueryScale

__all__ = ["AttentionMatch", "DecomposedAttentionQueryScale", "GroupQueryAttentionQueryScale", "MatchFailure",
           "OnnxAttentionQueryScale", "ScoreMask", "fail", "is_query_scale_mul", "score_masks",
           "visible_keys_from_masks"]
