"""ONNX Runtime engines for the target and the DFlash drafter of an engines/ folder, with their KV caches.

Both keep batch 1 state here (the vertical slice); each owns its cache as a list of numpy arrays
``[1, kv_heads, kv_len, head_dim]``. Rollback is a slice (a view: no copy of the kept prefix).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from runtime.manifest import read_initializer


def session_options(threads: int | None = None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads or int(os.environ.get("SHARPDRAFT_THREADS", 0)) or (os.cpu_count() or 1)
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    return so


def providers(device: str = "auto") -> list[str]:
    """["CUDAExecutionProvider", "CPUExecutionProvider"] when onnxruntime-gpu sees a GPU (and device != cpu)."""
    import onnxruntime as ort

    avail = ort.get_available_providers()
    if device in ("auto", "cuda") and "CUDAExecutionProvider" in avail:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    if device == "cuda":
        raise RuntimeError("device=cuda needs onnxruntime-gpu and a CUDA GPU; install the `gpu` extra or use cpu")
    return ["CPUExecutionProvider"]


class _CachedGraph:
    """One ONNX Runtime session whose KV cache (flat past/present tensors) this object owns.

    ``kv``: list over layers of K then V, each ``[1, kv_heads, kv_len, head_dim]`` float32. Rollback is a slice.
    """

    def __init__(self, engine_dir: Path, graph: dict[str, Any], dims: tuple[int, int, int], device: str,
                 threads: int | None):
        import onnxruntime as ort

        self.session = ort.InferenceSession(str(engine_dir / graph["file"]), session_options(threads),
                                            providers=providers(device))
        self.num_layers, self.kv_heads, self.head_dim = dims
        self.kv_names = [n for n in graph["inputs"] if n.startswith("past_")]
        self.out_names = graph["outputs"]
        self.reset()

    def reset(self) -> None:
        empty = np.zeros((1, self.kv_heads, 0, self.head_dim), np.float32)
        self.kv = [empty] * (2 * self.num_layers)

    @property
    def kv_len(self) -> int:
        return self.kv[0].shape[2]

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` cached positions (rollback of rejected tokens)."""
        assert 0 <= length <= self.kv_len, (length, self.kv_len)
        self.kv = [t[:, :, :length] for t in self.kv]


class OrtTarget(_CachedGraph):
    """Target graph + KV cache. ``forward`` appends to the cache; ``truncate`` rolls it back."""

    def __init__(self, engine_dir: Path, manifest: dict[str, Any], device: str = "auto", threads: int | None = None):
        t = manifest["target"]
        super().__init__(engine_dir, manifest["graphs"]["target"],
                         (t["num_layers"], t["num_key_value_heads"], t["head_dim"]), device, threads)
        self.max_positions = t["max_position_embeddings"]

    def forward(self, input_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Run ``input_ids`` [1, q_len] int64 at positions kv_len .. kv_len + q_len - 1 and append their K/V.

        Returns logits [1, q_len, vocab] f32 and taps [1, q_len, F] f32.
        Raises ValueError if the positions would pass the target's max_position_embeddings.
        """
        q = input_ids.shape[1]
        start = self.kv_len
        if start + q > self.max_positions:
            raise ValueError(f"sequence of {start + q} tokens exceeds the target's {self.max_positions} positions")
        feed = {"input_ids": input_ids.astype(np.int64),
                "position_ids": np.arange(start, start + q, dtype=np.int64)[None],
                "attention_mask": np.ones((1, start + q), np.int64)}
        feed.update(zip(self.kv_names, self.kv))
        logits, taps, *present = self.session.run(self.out_names, feed)
        self.kv = present
        return logits, taps


class OrtDFlashDrafter(_CachedGraph):
    """DFlash drafter graph + its context KV cache (holds only verified context: block K/V are never returned)."""

    def __init__(self, engine_dir: Path, manifest: dict[str, Any], device: str = "auto", threads: int | None = None):
        d = manifest["drafter"]["config"]
        super().__init__(engine_dir, manifest["graphs"]["drafter"],
                         (d["num_hidden_layers"], d["num_key_value_heads"], d["head_dim"]), device, threads)
        self.block_size = d["block_size"]
        self.mask_token_id = d["dflash_config"]["mask_token_id"]
        self.max_positions = d["max_position_embeddings"]
        target_graph = engine_dir / manifest["graphs"]["target"]["file"]
        self.shared = {name: _shared_tensor(target_graph, spec) for name, spec in manifest["shared_weights"].items()}

    def draft(self, bonus_token: int, target_hidden: np.ndarray) -> np.ndarray:
        """Draft B-1 tokens after ``bonus_token``.

        Args:
            bonus_token: the last token the target produced (block slot 0), at position s = kv_len + ctx_len.
            target_hidden: [1, ctx_len, F] f32 taps of the verified positions not yet in the cache
                (ctx_len >= 1: the positions kv_len .. s - 1).
        Returns:
            logits [B - 1, vocab] f32 for slots 1..B-1. The cache then covers positions 0 .. s - 1.
        """
        ctx = target_hidden.shape[1]
        start = self.kv_len
        block = np.full((1, self.block_size), self.mask_token_id, np.int64)
        block[0, 0] = bonus_token
        feed = {"input_ids": block, "target_hidden": target_hidden.astype(np.float32),
                "position_ids": np.arange(start, start + ctx + self.block_size, dtype=np.int64)[None]}
        feed.update(zip(self.kv_names, self.kv))
        feed.update(self.shared)
        logits, *present = self.session.run(self.out_names, feed)
        self.kv = present
        return logits[0]


def _shared_tensor(target_graph: Path, spec: dict) -> np.ndarray:
    w = read_initializer(target_graph, spec["initializer"])
    return np.ascontiguousarray(w.T) if spec.get("transpose") else w
