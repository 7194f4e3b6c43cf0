"""Add SharpDraft's query scale to TensorRT-LLM's own DFlash, PARD and Eagle3 drafters (PyTorch backend).

What it does: every drafter query is multiplied by beta(N) (``plugins.rule``), fp32, after q-norm and after RoPE
(or before a RoPE that is fused into the attention op: RoPE is linear, so the product is the same), right before
the attention op. The target model is never touched. This is the Llama 4 pattern of TensorRT-LLM itself
(``Llama4Attention._attention_scaling`` in ``tensorrt_llm/_torch/models/modeling_llama.py``: split the fused qkv,
``q * scale(position_ids)``, re-fuse, call the op).

Written against NVIDIA/TensorRT-LLM main as of 2026-09 (:data:`SUPPORTED`); TensorRT-LLM cannot be installed
here (no GPU, no CUDA), so the hook points below were read from source and are exercised only on stand-ins that
mirror them (tests/plugins/test_trtllm_patch.py). Files and commits read:

- ``tensorrt_llm/_torch/models/modeling_speculative.py`` @00679c66: ``Eagle3Attention(Attention)`` (no forward
  override; only a wider ``qkv_proj``), ``Eagle3MLAttention(MLA)``, ``Eagle3DecoderLayer``, ``Eagle3DraftModel``
  (layers in ``midlayer``), ``PARDForCausalLM`` (wraps ``draft_model_full``, an instance of the *target
  architecture's* class built with ``get_model_architecture``; the PARD worker calls ``draft_model.model(...)``).
- ``tensorrt_llm/_torch/attention/attention.py`` @930bd1a7 (older trees: ``tensorrt_llm/_torch/modules/attention.py``):
  ``Attention.forward`` = ``qkv_proj`` -> ``preprocess_qkv(qkv, position_ids)`` (gate split + ``apply_rope``, which
  subclasses override to add q/k-norm; RoPE itself is skipped when ``rope_fusion`` puts it in the op) ->
  ``convert_qkv`` -> ``forward_impl`` -> ``self.attn.forward``. q is ``[num_tokens, q_size]`` or the fused
  ``[num_tokens, q_size + 2 * kv_size]`` (k, v None).
- ``tensorrt_llm/_torch/models/modeling_dflash.py`` @7c7504c0: ``DFlashForCausalLM.dflash_forward(noise_embedding,
  query_positions, num_ctx_per_req, ctx_k_cache, ctx_v_cache, ctx_cache_batch_idx, ...)`` is a hand-written block
  decode that does NOT go through ``Attention.forward``: per layer it runs ``qkv_proj``, q/k-norm and RoPE itself,
  then calls one of three kernels held on the instance: ``self._dflash_flash_attention(q=, k_cache=, v_cache=,
  cache_seqlens=, cache_batch_idx=, causal=, window_size=)`` (VANILLA), ``self._dflash_trtllm_gen_ops
  .batch_decode_with_kv_cache / .batch_context_with_kv_cache(query=, ..., seq_lens=, window_left=, ...)`` (TRTLLM,
  a frozen ``DFlashTrtllmGenOps`` dataclass, ``tensorrt_llm/_torch/speculative/dflash_attention.py`` @58ae162a),
  or ``self._dflash_fa4_fwd(Q, k_pages, v_pages, seqused_k=, window_size_left=, ...)`` (FA4). In every case the
  kernel's key length is ``seq_lens_after = num_ctx_per_req + block_size``, i.e. N = s + B.
- ``tensorrt_llm/_torch/attention/backends/fmha/interface.py`` @b0a6e828: ``FmhaParams`` (slots dataclass) has
  ``use_logn_scaling: bool``, ``logn_scaling_ptr: Optional[Tensor]`` (fp32), a Python-only back-reference ``attn``
  and ``to_thop_params()`` that lowers it to the native op.
- ``tensorrt_llm/_torch/speculative/pard.py`` @80aa8caf: PARD positions are ``kv_lens - 2K + i`` (after its +1
  ``kv_lens`` shift), consistent with the kernel's own ``kv_lens - seq_lens + i``.

How N (visible keys) is derived, and from what:

- PARD, Eagle3 (causal): N = ``position_ids + 1`` per token, from the ``position_ids`` that ``Attention.forward``
  hands to ``preprocess_qkv`` (already adjusted for dynamic trees when RoPE is not fused). Unverified: with a fused
  RoPE and a *static* Eagle3 tree the op derives tree positions from its spec-dec offsets, which may differ from
  ``position_ids``.
- DFlash (non-causal block of B slots after s context tokens): N = s + B for every slot, read from the kernel's own
  key-length argument (``cache_seqlens`` / ``seq_lens`` / ``seqused_k`` = ``num_ctx_per_req + block_size``), per
  request. For a sliding-window layer (window argument >= 0) N = min(s + B, window_left + 1), the per-layer rule of
  docs/design.md §1 (for the symmetric DFlash window the exact per-row count is up to B - 1 larger).

Routes: ``"multiply"`` (Option A, all families) and ``"logn_table"`` (Option B, PARD and Eagle3 only, UNVERIFIED:
sets ``FmhaParams.use_logn_scaling`` / ``logn_scaling_ptr = T`` with ``T[p] = beta(p + 1)`` for the drafter's
TrtllmAttention layers; whether every native FMHA path honours the table, and how spec-dec/tree positions index it,
has not been run). DFlash always uses ``"multiply"`` (its block decode never builds ``FmhaParams``).

Everything that decides *what* to patch and *how N is computed* is plain data and plain functions here, tested
without TensorRT-LLM; the installer only resolves names and swaps attributes.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import threading
import weakref
from typing import Any, Callable, Mapping

import torch

from plugins.rule import Family, QueryScaleProfile, Vocabulary, beta_torch, visible_keys
from plugins.trtllm_tables import logn_scaling_table

SUPPORTED = (
    "NVIDIA/TensorRT-LLM main as of 2026-09 (models/modeling_speculative.py @00679c66, "
    "models/modeling_dflash.py @7c7504c0, attention/attention.py @930bd1a7, "
    "attention/backends/fmha/interface.py @b0a6e828)"
)
FAMILIES = tuple(f.value for f in Family)
class Route(Vocabulary):
    """How beta reaches TensorRT-LLM's attention (module docstring). A ``str`` enum: equal to its value."""

    MULTIPLY = "multiply"  # q * beta in PyTorch before the kernel (all families)
    LOGN_TABLE = "logn_table"  # FmhaParams' log-n scaling table (PARD, Eagle3; unverified on a GPU)


ROUTES = tuple(r.value for r in Route)

# ---------------------------------------------------------------------------------------------------------------
# Where things live (data, not if-chains). First importable candidate wins.
# ---------------------------------------------------------------------------------------------------------------
SPECULATIVE_MODULE = "tensorrt_llm._torch.models.modeling_speculative"
DFLASH_MODULE = "tensorrt_llm._torch.models.modeling_dflash"
ATTENTION_MODULES = ("tensorrt_llm._torch.attention.attention", "tensorrt_llm._torch.modules.attention")
FMHA_INTERFACE_MODULES = (
    "tensorrt_llm._torch.attention.backends.fmha.interface",
    "tensorrt_llm._torch.attention_backend.fmha.interface",
)


@dataclasses.dataclass(frozen=True)
class DrafterHook:
    """One drafter family: the class whose ``method`` is wrapped, and the classes that must exist next to it."""

    family: Family
    module: str
    cls: str
    method: str
    also_required: tuple[str, ...] = ()
    unsupported_attention: tuple[str, ...] = ()  # attention classes found in the drafter that we refuse to patch
    # True: the family's block decode calls its kernels itself; ``method`` (on the class) is wrapped and beta is
    # multiplied into q there ("multiply" route only). False: the drafter's Attention instances are patched after
    # ``method`` (``__init__``) and either route applies.
    block_decode: bool = False


DRAFTER_HOOKS: dict[Family, DrafterHook] = {
    # Eagle3DraftModel builds Eagle3DecoderLayer -> Eagle3Attention; patched per instance after __init__.
    Family.EAGLE3: DrafterHook(Family.EAGLE3, SPECULATIVE_MODULE, "Eagle3DraftModel", "__init__",
                               also_required=("Eagle3Attention", "Eagle3DecoderLayer"),
                               unsupported_attention=("Eagle3MLAttention",)),
    # PARD's drafter is the target architecture's own class: patch only the instances inside PARDForCausalLM.
    Family.PARD: DrafterHook(Family.PARD, SPECULATIVE_MODULE, "PARDForCausalLM", "__init__"),
    # DFlash's block decode calls its kernels itself: wrap dflash_forward (class-level, drafter-only class).
    Family.DFLASH: DrafterHook(Family.DFLASH, DFLASH_MODULE, "DFlashForCausalLM", "dflash_forward",
                               block_decode=True),
}

# Attention methods that return q after q-norm and (unfused) RoPE; the first one the class has is wrapped.
# preprocess_qkv(qkv, position_ids) -> (q, k, v, gate) on 2026 main; apply_rope(q, k, v, position_ids) -> (q, k, v)
# on older trees (and is what preprocess_qkv calls).
ATTENTION_Q_HOOKS = ("preprocess_qkv", "apply_rope")
ATTENTION_REQUIRED = ("split_qkv", "convert_qkv", "forward")


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """How one DFlash attention kernel receives q, the per-request key length N and the window."""

    attr: str                      # instance attribute of DFlashForCausalLM holding the kernel (or the ops object)
    fields: tuple[str, ...]        # () = the attribute itself is the callable; else callables on the ops object
    q_kw: str
    q_pos: int | None              # positional index of q when passed positionally
    kv_lens_kw: str
    window_kw: str


DFLASH_KERNELS = (
    KernelSpec("_dflash_flash_attention", (), "q", 0, "cache_seqlens", "window_size"),
    KernelSpec("_dflash_trtllm_gen_ops", ("batch_decode_with_kv_cache", "batch_context_with_kv_cache"),
               "query", None, "seq_lens", "window_left"),
    KernelSpec("_dflash_fa4_fwd", (), "q", 0, "seqused_k", "window_size_left"),
)


class TrtllmStructureError(RuntimeError):
    """The installed TensorRT-LLM does not have the classes/attributes this patch was written against."""


def _structure_error(version: str, missing: str) -> TrtllmStructureError:
    return TrtllmStructureError(f"TensorRT-LLM {version} lacks {missing}; supported: {SUPPORTED}")


# ---------------------------------------------------------------------------------------------------------------
# Pure functions (no TensorRT-LLM needed)
# ---------------------------------------------------------------------------------------------------------------
def causal_visible_keys(position_ids: torch.Tensor | None, num_tokens: int) -> torch.Tensor:
    """N for causal drafters (PARD, Eagle3): ``position_ids + 1`` for the first ``num_tokens`` packed tokens.

    Args:
        position_ids: int 0-based positions, ``[num_tokens]`` or ``[1, num_tokens]`` (TensorRT-LLM passes both);
            extra trailing entries (padding) are ignored.
        num_tokens: rows of q.
    Returns:
        int64 ``[num_tokens]``.
    Raises:
        ValueError: position_ids is None or has fewer than ``num_tokens`` entries (N cannot be known).
    """
    if position_ids is None:
        raise ValueError("the drafter attention got position_ids=None; SharpDraft needs positions to compute N")
    flat = position_ids.reshape(-1)
    if flat.numel() < num_tokens:
        raise ValueError(f"position_ids has {flat.numel()} entries for {num_tokens} query rows")
    return flat[:num_tokens].to(torch.int64) + 1


def window_left_of(window: Any) -> int | None:
    """Normalise a kernel's window argument to its left extent (None = no window).

    Accepts flash-attn's ``(left, right)`` tuple, an int (trtllm-gen ``window_left``) or None (FA4
    ``window_size_left``); negative means no window.
    """
    if window is None:
        return None
    if isinstance(window, (tuple, list)):
        window = window[0]
    window = int(window)
    return window if window >= 0 else None


def block_visible_keys(kv_lens: torch.Tensor, window_left: int | None = None) -> torch.Tensor:
    """N for DFlash: the kernel's key length per request (``num_ctx_per_req + block_size`` = s + B).

    Args:
        kv_lens: int ``[batch]`` key length each request's block attends over.
        window_left: left window extent of this layer, or None. With a window, N = min(s + B, window_left + 1).
    Returns:
        int64 ``[batch]``.
    """
    return visible_keys(kv_lens, 1, causal=False, window=None if window_left is None else window_left + 1)[:, 0]


def scale_rows(x: torch.Tensor, num_keys: torch.Tensor, profile: QueryScaleProfile) -> torch.Tensor:
    """``x * beta(num_keys)`` row-wise: beta in fp32, product in fp32, cast back to ``x.dtype``.

    Args:
        x: ``[rows, ...]`` (e.g. ``[num_tokens, heads * head_dim]``), any float dtype.
        num_keys: int ``[rows]``.
    Returns:
        Same shape and dtype as x (a new tensor).
    """
    beta = beta_torch(num_keys, profile).to(x.device)
    return (x.float() * beta.reshape(-1, *([1] * (x.dim() - 1)))).to(x.dtype)


def scale_query_in_qkv(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, num_keys: torch.Tensor,
                       q_size: int, profile: QueryScaleProfile):
    """Scale only the query part of what ``Attention.preprocess_qkv`` / ``apply_rope`` returns.

    Args:
        q: ``[num_tokens, q_size]``, or the fused ``[num_tokens, q_size + 2 * kv_size]`` when k and v are None.
        k, v: ``[num_tokens, kv_size]`` or None (fused layout); returned unchanged.
        num_keys: int ``[num_tokens]`` (see :func:`causal_visible_keys`).
        q_size: heads * head_dim of this rank (``Attention.q_size``).
    Returns:
        ``(q, k, v)`` in the same layout they came in.
    """
    if k is None and v is None and q.shape[-1] != q_size:
        q_part, kv_part = q.split([q_size, q.shape[-1] - q_size], dim=-1)
        return torch.cat([scale_rows(q_part, num_keys, profile), kv_part], dim=-1), k, v
    return scale_rows(q, num_keys, profile), k, v


def scale_block_query(q: torch.Tensor, num_keys: torch.Tensor, profile: QueryScaleProfile) -> torch.Tensor:
    """Scale a DFlash block query by one beta per request.

    Args:
        q: ``[batch, rows, heads, head_dim]`` (flash-attn / FA4; rows may be GQA-packed ``group * block``) or
            ``[batch * rows, heads, head_dim]`` (trtllm-gen), any float dtype.
        num_keys: int ``[batch]`` (see :func:`block_visible_keys`).
    Returns:
        Same shape and dtype as q.
    Raises:
        ValueError: the leading dim is not a multiple of the batch.
    """
    batch = num_keys.shape[0]
    if q.shape[0] == batch:
        return scale_rows(q, num_keys, profile)
    if batch == 0 or q.shape[0] % batch:
        raise ValueError(f"query rows {q.shape[0]} are not a multiple of the batch {batch}")
    grouped = q.reshape(batch, q.shape[0] // batch, *q.shape[1:])
    return scale_rows(grouped, num_keys, profile).reshape(q.shape)


@dataclasses.dataclass
class _Counter:
    q_scaled: int = 0       # Python-side calls that multiplied q (at CUDA-graph capture, not per replay)
    logn_applied: int = 0   # FmhaParams lowered with the table


def scaling_kernel(fn: Callable, spec: KernelSpec, profile: QueryScaleProfile, counter: _Counter) -> Callable:
    """Wrap one DFlash attention kernel so its q is multiplied by beta(N), N from its own key-length argument.

    Raises (when called):
        TrtllmStructureError: the call has no ``spec.kv_lens_kw`` keyword or no q.
    """

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if spec.kv_lens_kw not in kwargs:
            raise TrtllmStructureError(
                f"DFlash kernel {spec.attr} was called without {spec.kv_lens_kw}=; supported: {SUPPORTED}")
        n = block_visible_keys(kwargs[spec.kv_lens_kw], window_left_of(kwargs.get(spec.window_kw)))
        if spec.q_kw in kwargs:
            kwargs[spec.q_kw] = scale_block_query(kwargs[spec.q_kw], n, profile)
        elif spec.q_pos is not None and len(args) > spec.q_pos:
            args = (*args[:spec.q_pos], scale_block_query(args[spec.q_pos], n, profile), *args[spec.q_pos + 1:])
        else:
            raise TrtllmStructureError(f"DFlash kernel {spec.attr} was called without {spec.q_kw}=; "
                                       f"supported: {SUPPORTED}")
        counter.q_scaled += 1
        return fn(*args, **kwargs)

    wrapped._sharpdraft_original = fn
    return wrapped


def _replace_fields(obj: Any, changes: dict[str, Any]) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **changes)
    import copy

    clone = copy.copy(obj)
    for name, value in changes.items():
        setattr(clone, name, value)
    return clone


def scaled_dflash_kernels(model: Any, profile: QueryScaleProfile, counter: _Counter) -> dict[str, Any]:
    """Scaling replacements for the kernel attributes a ``DFlashForCausalLM`` instance actually holds.

    Returns:
        ``{attribute name: replacement}``; the caller sets them for the duration of one ``dflash_forward``.
    Raises:
        TrtllmStructureError: none of the known kernel attributes is set on the instance.
    """
    out = {}
    for spec in DFLASH_KERNELS:
        current = model.__dict__.get(spec.attr)
        if current is None:
            continue
        if not spec.fields:
            out[spec.attr] = scaling_kernel(current, spec, profile, counter)
        else:
            out[spec.attr] = _replace_fields(
                current, {f: scaling_kernel(getattr(current, f), spec, profile, counter) for f in spec.fields})
    if not out:
        raise TrtllmStructureError(
            f"DFlashForCausalLM instance has none of the kernel attributes "
            f"{[s.attr for s in DFLASH_KERNELS]}; supported: {SUPPORTED}")
    return out


# ---------------------------------------------------------------------------------------------------------------
# Installer state
# ---------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class InstallReport:
    """What :func:`install_query_scale` did: per family the route, the hooked class.method and its profile."""

    version: str
    routes: dict[str, str]
    hooks: dict[str, str]
    profiles: dict[str, QueryScaleProfile]


@dataclasses.dataclass
class _State:
    key: tuple
    report: InstallReport
    class_patches: list = dataclasses.field(default_factory=list)   # (cls, name, had_own, original)
    instances: "weakref.WeakKeyDictionary" = dataclasses.field(default_factory=weakref.WeakKeyDictionary)
    counters: dict = dataclasses.field(default_factory=dict)
    attention_base: type | None = None
    logn_len: int | None = None


_LOCK = threading.RLock()
_STATE: _State | None = None


def _import_trtllm():
    try:
        return importlib.import_module("tensorrt_llm")
    except ImportError as e:  # includes a None entry in sys.modules
        raise ImportError(
            "plugins.trtllm_patch needs TensorRT-LLM (PyTorch backend) importable in this process (a CUDA machine "
            f"with `pip install tensorrt-llm`, built from {SUPPORTED}); it is not: {e}") from e


def _first_attr(modules: tuple[str, ...], name: str, version: str) -> Any:
    for mod in modules:
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        if hasattr(m, name):
            return getattr(m, name)
    raise _structure_error(version, f"{name} in any of {list(modules)}")


def _resolve(hook: DrafterHook, version: str):
    try:
        mod = importlib.import_module(hook.module)
    except ImportError as e:
        raise _structure_error(version, f"module {hook.module} ({e})") from e
    for name in (hook.cls, *hook.also_required):
        if not hasattr(mod, name):
            raise _structure_error(version, f"{hook.module}.{name}")
    cls = getattr(mod, hook.cls)
    if not callable(getattr(cls, hook.method, None)):
        raise _structure_error(version, f"{hook.module}.{hook.cls}.{hook.method}")
    return cls


def _check_attention_base(base: type, version: str) -> None:
    missing = [n for n in ATTENTION_REQUIRED if not callable(getattr(base, n, None))]
    if not any(callable(getattr(base, n, None)) for n in ATTENTION_Q_HOOKS):
        missing.append(" or ".join(ATTENTION_Q_HOOKS))
    if missing:
        raise _structure_error(version, f"{base.__module__}.{base.__name__}.{', '.join(missing)}")


def _patch_class(state: _State, cls: type, name: str, replacement: Callable) -> None:
    had_own = name in cls.__dict__
    state.class_patches.append((cls, name, had_own, cls.__dict__.get(name)))
    setattr(cls, name, replacement)


def _q_hook_name(module: Any) -> str:
    for name in ATTENTION_Q_HOOKS:
        if callable(getattr(type(module), name, None)):
            return name
    raise _structure_error(_STATE.report.version if _STATE else "?",
                           f"{type(module).__name__}.{' or '.join(ATTENTION_Q_HOOKS)}")


def _make_q_hook(module: Any, name: str, profile: QueryScaleProfile, counter: _Counter) -> Callable:
    bound = getattr(type(module), name).__get__(module, type(module))
    q_size = module.q_size

    if name == "preprocess_qkv":
        def hook(qkv, position_ids):
            q, k, v, gate = bound(qkv, position_ids)
            n = causal_visible_keys(position_ids, q.shape[0])
            q, k, v = scale_query_in_qkv(q, k, v, n, q_size, profile)
            counter.q_scaled += 1
            return q, k, v, gate
    else:
        def hook(q, k, v, position_ids):
            q, k, v = bound(q, k, v, position_ids)
            n = causal_visible_keys(position_ids, q.shape[0])
            q, k, v = scale_query_in_qkv(q, k, v, n, q_size, profile)
            counter.q_scaled += 1
            return q, k, v
    return hook


class _LognRoute:
    """The table a drafter TrtllmAttention layer should hand to the op (UNVERIFIED route, see module doc)."""

    def __init__(self, table: torch.Tensor, counter: _Counter):
        self.table, self.counter, self._by_device = table, counter, {}

    def on(self, device) -> torch.Tensor:
        key = str(device)
        if key not in self._by_device:
            self._by_device[key] = self.table.to(device)
        return self._by_device[key]


def apply_to_model(model: Any, family: str) -> int:
    """Patch the attention modules of one already-built drafter (PARD or Eagle3) per the installed config.

    Called automatically after ``PARDForCausalLM.__init__`` / ``Eagle3DraftModel.__init__`` once installed; call it
    yourself for a drafter built before :func:`install_query_scale`. Idempotent per module.

    Args:
        model: an ``nn.Module`` (the drafter wrapper); only modules inside it are touched.
        family: "pard" or "eagle3".
    Returns:
        Number of attention modules patched by this call.
    Raises:
        RuntimeError: nothing installed. TrtllmStructureError: the drafter holds no ``Attention`` module, holds an
        unsupported one (Eagle3 MLA), or a module lacks ``q_size`` / the q hook / (logn route) a TrtllmAttention
        ``attn`` backend.
    """
    with _LOCK:
        state = _STATE
        if state is None or family not in state.report.routes:
            raise RuntimeError(f"SharpDraft query scale is not installed for {family!r}")
        hook = DRAFTER_HOOKS[family]
        version = state.report.version
        bad = [type(m).__name__ for m in model.modules() if type(m).__name__ in hook.unsupported_attention]
        if bad:
            raise _structure_error(version, f"support for {sorted(set(bad))} drafter layers in this patch "
                                            f"(only GQA Attention subclasses are scaled)")
        mods = [m for m in model.modules() if isinstance(m, state.attention_base)]
        if not mods:
            raise _structure_error(version, f"any {state.attention_base.__name__} module inside {type(model).__name__}")
        profile, route, counter = state.report.profiles[family], state.report.routes[family], state.counters[family]
        patched = 0
        for m in mods:
            if m in state.instances:
                continue
            if not hasattr(m, "q_size"):
                raise _structure_error(version, f"{type(m).__name__}.q_size")
            undo = []
            if route == Route.MULTIPLY:
                name = _q_hook_name(m)
                m.__dict__[name] = _make_q_hook(m, name, profile, counter)
                undo.append((m, name))
            else:
                backend = getattr(m, "attn", None)
                if backend is None or "Trtllm" not in type(backend).__name__:
                    raise _structure_error(version, f"a TrtllmAttention backend on {type(m).__name__}.attn "
                                                    f"(route='logn_table' needs attn_backend='TRTLLM'; got "
                                                    f"{type(backend).__name__})")
                length = state.logn_len or int(getattr(m, "max_position_embeddings", 0) or 0)
                if length < 1:
                    raise ValueError("route='logn_table' needs logn_table_length (>= max_seq_len)")
                backend.__dict__["_sharpdraft_logn_route"] = _LognRoute(logn_scaling_table(length, profile), counter)
                undo.append((backend, "_sharpdraft_logn_route"))
            state.instances[m] = undo
            patched += 1
        return patched


def _wrap_init(family: str, original: Callable) -> Callable:
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        apply_to_model(self, family)

    __init__._sharpdraft_original = original
    return __init__


def _wrap_dflash_forward(original: Callable, profile: QueryScaleProfile, counter: _Counter) -> Callable:
    @functools.wraps(original)
    def dflash_forward(self, *args, **kwargs):
        if self.__dict__.get("_sharpdraft_in_block_decode"):  # a subclass override calling super(): scale once
            return original(self, *args, **kwargs)
        swaps = scaled_dflash_kernels(self, profile, counter)
        saved = {name: self.__dict__[name] for name in swaps}
        self.__dict__.update(swaps, _sharpdraft_in_block_decode=True)
        try:
            return original(self, *args, **kwargs)
        finally:
            self.__dict__.update(saved)
            self.__dict__.pop("_sharpdraft_in_block_decode", None)

    dflash_forward._sharpdraft_original = original
    return dflash_forward


def _wrap_to_thop_params(original: Callable) -> Callable:
    @functools.wraps(original)
    def to_thop_params(self, *args, **kwargs):
        route = getattr(getattr(self, "attn", None), "_sharpdraft_logn_route", None)
        if route is not None:
            device = self.qkv_or_q.device if getattr(self, "qkv_or_q", None) is not None else "cpu"
            self.use_logn_scaling = True
            self.logn_scaling_ptr = route.on(device)
            route.counter.logn_applied += 1
        return original(self, *args, **kwargs)

    to_thop_params._sharpdraft_original = original
    return to_thop_params


def install_query_scale(profile_by_family: Mapping[str, QueryScaleProfile] | None = None, *,
                        route: str = "multiply", logn_table_length: int | None = None) -> InstallReport:
    """Patch TensorRT-LLM's DFlash / PARD / Eagle3 drafters so every drafter query is multiplied by beta(N).

    Call it in every process that builds the drafter, before the model is constructed (with the LLM API set
    ``TLLM_WORKER_USE_SINGLE_PROCESS=1`` so the executor runs in this process; see examples/trtllm/).

    Args:
        profile_by_family: ``{"dflash"|"pard"|"eagle3": QueryScaleProfile}``; only the families given are patched.
            None = all three with ``QueryScaleProfile.for_family`` presets (ref_keys 2048 / 8192 / 2048).
        route: "multiply" (q * beta in PyTorch, fp32, Llama 4 pattern; verified on stand-ins) or "logn_table"
            (PARD / Eagle3 only: ``FmhaParams.use_logn_scaling`` + ``logn_scaling_ptr``; UNVERIFIED on a GPU).
            DFlash always uses "multiply".
        logn_table_length: table length for "logn_table" (>= the engine's max_seq_len); default: each attention
            module's ``max_position_embeddings``.
    Returns:
        :class:`InstallReport`. Installing the same configuration again is a no-op returning the same report.
    Raises:
        ImportError: tensorrt_llm cannot be imported.
        TrtllmStructureError: a class / method / attribute this patch hooks is missing ("TensorRT-LLM X lacks Y;
            supported: ..."). Nothing is patched in that case.
        ValueError: unknown family / route, or a profile that is not a QueryScaleProfile.
        RuntimeError: a different configuration is already installed (call :func:`uninstall` first).
    """
    global _STATE
    if route not in ROUTES:
        raise ValueError(f"route must be one of {', '.join(ROUTES)}, got {route!r}")
    route = Route(route)
    profiles = dict(profile_by_family) if profile_by_family is not None else {
        f: QueryScaleProfile.for_family(f) for f in Family}
    for fam, prof in profiles.items():
        if fam not in FAMILIES:
            raise ValueError(f"unknown drafter family {fam!r}; expected a subset of {FAMILIES}")
        if not isinstance(prof, QueryScaleProfile):
            raise ValueError(f"profile for {fam!r} must be a QueryScaleProfile, got {type(prof).__name__}")
    if not profiles:
        raise ValueError("profile_by_family is empty: nothing to install")
    key = (tuple(sorted(profiles.items(), key=lambda kv: kv[0])), route, logn_table_length)

    with _LOCK:
        if _STATE is not None:
            if _STATE.key == key:
                return _STATE.report
            raise RuntimeError("a different SharpDraft TensorRT-LLM patch is installed; call uninstall() first")
        trtllm = _import_trtllm()
        version = str(getattr(trtllm, "__version__", "<unknown version>"))

        # Resolve everything first: a missing piece raises before anything is patched.
        classes = {fam: _resolve(DRAFTER_HOOKS[fam], version) for fam in profiles}
        attention_base = None
        per_instance = [fam for fam in profiles if not DRAFTER_HOOKS[fam].block_decode]
        if per_instance:
            attention_base = _first_attr(ATTENTION_MODULES, "Attention", version)
            _check_attention_base(attention_base, version)
        fmha_params = None
        if route == Route.LOGN_TABLE and per_instance:
            fmha_params = _first_attr(FMHA_INTERFACE_MODULES, "FmhaParams", version)
            fields = ({f.name for f in dataclasses.fields(fmha_params)}
                      if dataclasses.is_dataclass(fmha_params) else set())
            for needed in ("use_logn_scaling", "logn_scaling_ptr", "attn"):
                if needed not in fields:
                    raise _structure_error(version, f"FmhaParams.{needed}")
            if not callable(getattr(fmha_params, "to_thop_params", None)):
                raise _structure_error(version, "FmhaParams.to_thop_params")

        routes = {fam: (Route.MULTIPLY if DRAFTER_HOOKS[fam].block_decode else route) for fam in profiles}
        hooks = {fam: f"{DRAFTER_HOOKS[fam].module}.{DRAFTER_HOOKS[fam].cls}.{DRAFTER_HOOKS[fam].method}"
                 for fam in profiles}
        state = _State(key=key, report=InstallReport(version, routes, hooks, profiles),
                       counters={fam: _Counter() for fam in profiles}, attention_base=attention_base,
                       logn_len=logn_table_length)
        for fam, cls in classes.items():
            hook = DRAFTER_HOOKS[fam]
            if hook.block_decode:
                _patch_class(state, cls, hook.method,
                             _wrap_dflash_forward(cls.__dict__.get(hook.method) or getattr(cls, hook.method),
                                                  profiles[fam], state.counters[fam]))
                for sub in _all_subclasses(cls):  # subclasses with their own block decode get wrapped too
                    if hook.method in sub.__dict__:
                        _patch_class(state, sub, hook.method,
                                     _wrap_dflash_forward(sub.__dict__[hook.method], profiles[fam],
                                                          state.counters[fam]))
            else:
                _patch_class(state, cls, hook.method, _wrap_init(fam, getattr(cls, hook.method)))
        if fmha_params is not None:
            _patch_class(state, fmha_params, "to_thop_params", _wrap_to_thop_params(fmha_params.to_thop_params))
        _STATE = state
        return state.report


def _all_subclasses(cls: type) -> list[type]:
    out, todo = [], list(cls.__subclasses__())
    while todo:
        c = todo.pop()
        out.append(c)
        todo.extend(c.__subclasses__())
    return out


def uninstall() -> bool:
    """Undo :func:`install_query_scale`: restore every patched class attribute and drop every per-instance hook.

    Returns:
        True if something was installed, False otherwise (then it does nothing).
    """
    global _STATE
    with _LOCK:
        state = _STATE
        if state is None:
            return False
        for cls, name, had_own, original in reversed(state.class_patches):
            if had_own:
                setattr(cls, name, original)
            else:
                delattr(cls, name)
        for undo in list(state.instances.values()):
            for obj, name in undo:
                obj.__dict__.pop(name, None)
        _STATE = None
        return True


def installed() -> InstallReport | None:
    """The active :class:`InstallReport`, or None."""
    return _STATE.report if _STATE is not None else None


def stats() -> dict[str, dict[str, int]]:
    """Per family: ``q_scaled`` (Python calls that multiplied q) and ``logn_applied`` (FmhaParams lowered with the
    table). Counted when the Python code runs, i.e. once at CUDA-graph capture, not per replay. Use it after a
    warm-up request to check the hook fired (a zero means the drafter never reached it)."""
    if _STATE is None:
        return {}
    return {fam: dataclasses.asdict(c) for fam, c in _STATE.counters.items()}
