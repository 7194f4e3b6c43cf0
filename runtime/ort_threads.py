"""ONNX Runtime threads of the runtime's sessions: per-role settings, or one pool shared by every session.

Target and drafter sessions take turns on the same cores. With a pool per session (ONNX Runtime's default) the
target's pool spins after its run, so the drafter gets one thread (:data:`ROLE_DEFAULTS`); with
:func:`use_shared_thread_pool` both run on one process-wide pool (ONNX Runtime's global thread pool), so the draft
uses every core while the target is idle and no pool spins against another (measured on the 2-core Intel
AVX-512 machine, docs/round-cost.md: draft 16.8 -> 11.4 ms per round at 4k, speculative 1.33x -> 1.40x the
1-token path at k = 2; the target's own steps unchanged).

ONNX Runtime's global pool is process-wide and fixed when its environment is created (the first session of the
process): sizes given later are silently ignored, and once it exists every session must opt out of a pool of
its own. So the runtime's entry points (``runtime.generate``, ``runtime.serve``) make it before loading an
engine, and every session the runtime creates takes its options from :func:`session_options`.
"""
from __future__ import annotations

import os

# Per-role defaults on CPU with a pool per session (measured on the 2-core machine, docs/performance/README.md
# "Threads and spinning"): the target's pool spins after a run (ONNX Runtime's own default, what ORT GenAI runs
# with), the drafter runs on the calling thread alone, so it never competes with the target's spinning workers
# (speculative 1.1-1.3x faster per prompt, target-only 1.1-1.3x faster than with spinning off everywhere, at 1k).
ROLE_DEFAULTS = {"target": {"spin": "1", "threads": None}, "drafter": {"spin": "0", "threads": 1}}

THREAD_POOL_ENV = "SHARPDRAFT_ORT_THREAD_POOL"  # "shared" or "per-session" (entry points' --thread-pool default)
THREAD_POOLS = ("shared", "per-session")

_shared_threads: int | None = None  # the shared pool's threads, once made in this process
_sessions_made = 0  # sessions given per-session options (a shared pool can no longer be made after one)


def use_shared_thread_pool(threads: int | None = None) -> int:
    """Make one process-wide ONNX Runtime intra-op pool for every session this process creates from now on.

    Args:
        threads: the pool's threads (None: ``$SHARPDRAFT_THREADS``, else the CPU count).
    Returns:
        the pool's thread count (the first call's, when called again).
    Raises:
        RuntimeError: this process already created a session with a pool of its own through
            :func:`session_options` (ONNX Runtime would ignore the shared pool's size): call it first thing.
    """
    global _shared_threads
    if _shared_threads is not None:
        return _shared_threads
    if _sessions_made:
        raise RuntimeError("use_shared_thread_pool() must run before this process creates its first ONNX Runtime "
                           "session (ONNX Runtime fixes its thread pools when its environment is created); call it "
                           "before loading an engine, or use --thread-pool per-session")
    from onnxruntime.capi import _pybind_state

    n = threads or int(os.environ.get("SHARPDRAFT_THREADS", 0)) or (os.cpu_count() or 1)
    _pybind_state.set_global_thread_pool_sizes(n, 1)
    _shared_threads = n
    return n


def shared_thread_pool() -> int | None:
    """The shared pool's thread count, or None when sessions have pools of their own."""
    return _shared_threads


def session_options(threads: int | None = None, role: str | None = None):
    """ONNX Runtime session options of one graph (``role`` "target" / "drafter", or None for neither).

    With a shared pool (:func:`use_shared_thread_pool`) the session runs on it (``use_per_session_threads``
    False; threads and spinning are the pool's). Otherwise: threads ``$SHARPDRAFT_<ROLE>_THREADS``; else the
    drafter's default of 1 (:data:`ROLE_DEFAULTS`); else ``threads``, ``$SHARPDRAFT_THREADS``, the CPU count.
    Spinning of the intra-op pool after a run: ``$SHARPDRAFT_<ROLE>_SPIN``, else ``$SHARPDRAFT_ORT_SPIN``, else
    the role's default (target on, drafter off; off without a role).
    """
    import onnxruntime as ort

    global _sessions_made
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    if _shared_threads is not None:  # no thread counts: ONNX Runtime warns that a shared pool ignores them
        so.use_per_session_threads = False
        return so
    _sessions_made += 1
    so.inter_op_num_threads = 1
    env = os.environ.get
    tag = f"SHARPDRAFT_{role.upper()}_" if role else ""
    defaults = ROLE_DEFAULTS.get(role or "", {"spin": "0", "threads": None})
    so.intra_op_num_threads = (int(env(tag + "THREADS", 0)) if tag else 0) or defaults["threads"] or threads or int(
        env("SHARPDRAFT_THREADS", 0)) or (os.cpu_count() or 1)
    # Both sessions spinning on the same cores is the worst case: a pool left spinning after its run steals the
    # cores from the next session's threads (measured: in-loop verify 88 ms vs 54 ms at 2 cores).
    spin = (env(tag + "SPIN") if tag else None) or env("SHARPDRAFT_ORT_SPIN") or defaults["spin"]
    so.add_session_config_entry("session.intra_op.allow_spinning", spin)
    return so


def click_option():
    """``--thread-pool shared|per-session`` of runtime.generate / runtime.serve (default ``$SHARPDRAFT_ORT_THREAD_POOL``,
    else shared); the command receives the choice and calls :func:`apply` before loading an engine."""
    import click

    return click.option("--thread-pool", "thread_pool", type=click.Choice(THREAD_POOLS),
                        default=lambda: os.environ.get(THREAD_POOL_ENV, "shared"),
                        show_default="shared, or $SHARPDRAFT_ORT_THREAD_POOL",
                        help="shared: target and drafter on one ONNX Runtime pool (the draft uses every core); "
                             "per-session: a pool each, the drafter on one thread (runtime/ort_threads.py)")


def apply(choice: str, threads: int | None = None) -> None:
    """Act on a ``--thread-pool`` choice: "shared" makes the pool (:func:`use_shared_thread_pool`).

    Raises:
        ValueError: an unknown choice.
        RuntimeError: as :func:`use_shared_thread_pool`.
    """
    if choice not in THREAD_POOLS:
        raise ValueError(f"thread pool {choice!r}: choose one of {', '.join(THREAD_POOLS)}")
    if choice == "shared":
        use_shared_thread_pool(threads)
