"""Shared fixtures: a tiny random-weight Llama target and a tiny DFlash checkpoint in the public format.

The tiny target reuses SmolLM2's real tokenizer (vocab 49152) so tokenization paths are the real ones; its weights
are random (seeded), which is enough for losslessness, invariants, graph and error tests. The real default pair is
exercised in tests/e2e.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if not torch.cuda.is_available():  # Triton kernels run on CPU in Triton's interpreter (before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")
# runtime.generate / runtime.serve invoked in this process (click's CliRunner) must not make ONNX Runtime's
# process-wide pool (runtime/ort_threads.py): every later session of the test process would then need it. Tests of
# the shared pool run it in subprocesses with SHARPDRAFT_ORT_THREAD_POOL=shared.
os.environ["SHARPDRAFT_ORT_THREAD_POOL"] = "per-session"

TINY_VOCAB = 49152


def _tokenizer():
    from transformers import AutoTokenizer

    from runtime.models.target import resolve_target

    return AutoTokenizer.from_pretrained(resolve_target(None))


@pytest.fixture(scope="session")
def tokenizer():
    return _tokenizer()


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, tokenizer) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                      pad_token_id=2, rope_theta=10000.0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # untied, sharper LM head: greedy chains vary (a tied random model repeats its input)
        model.lm_head.weight.normal_(0, 1.0)
    path = tmp_path_factory.mktemp("tiny_target")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def dflash_layer_state(w, layers: int, h: int, nh: int, nkv: int, hd: int, inter: int) -> dict:
    """The ``layers.{i}.*`` tensors of a DFlash checkpoint (Qwen3 layers with q/k norms), drawn with ``w(*shape)``;
    norms are ``1 + w``. Shared by the z-lab and speculators layouts, whose layer keys are the same."""
    state = {}
    for i in range(layers):
        p = f"layers.{i}."
        state.update({p + "self_attn.q_proj.weight": w(nh * hd, h), p + "self_attn.k_proj.weight": w(nkv * hd, h),
                      p + "self_attn.v_proj.weight": w(nkv * hd, h), p + "self_attn.o_proj.weight": w(h, nh * hd),
                      p + "self_attn.q_norm.weight": 1 + w(hd), p + "self_attn.k_norm.weight": 1 + w(hd),
                      p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
                      p + "mlp.down_proj.weight": w(h, inter), p + "input_layernorm.weight": 1 + w(h),
                      p + "post_attention_layernorm.weight": 1 + w(h)})
    return state


def write_tiny_dflash(path: Path, *, mask_embedding: bool = True, block_size: int = 4, seed: int = 1,
                      query_scale: dict | None = None, sliding_window: int | None = None) -> Path:
    """Write a tiny DFlash checkpoint in exactly the public layout (config.json + model.safetensors);
    ``sliding_window``: layer 0 becomes a ``sliding_attention`` layer with that window (Qwen3.6 DFlash style)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    h, nh, nkv, hd, inter, layers = 64, 4, 2, 16, 96, 2
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": h,
           "num_hidden_layers": layers, "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": hd,
           "intermediate_size": inter, "vocab_size": TINY_VOCAB, "block_size": block_size,
           "num_target_layers": 4, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "max_position_embeddings": 4096, "attention_bias": False, "hidden_act": "silu",
           "layer_types": ["full_attention"] * layers, "tie_word_embeddings": False,
           "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
           "dflash_config": {"mask_token_id": TINY_VOCAB if mask_embedding else 7, "target_layer_ids": [0, 2]}}
    if query_scale is not None:
        cfg["sharpdraft_query_scale"] = query_scale
    if sliding_window is not None:
        cfg["layer_types"][0] = "sliding_attention"
        cfg.update(sliding_window=sliding_window, use_sliding_window=True)

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    state = {"fc.weight": w(h, 2 * h), "hidden_norm.weight": 1 + w(h), "norm.weight": 1 + w(h)}
    state.update(dflash_layer_state(w, layers, h, nh, nkv, hd, inter))
    if mask_embedding:
        state["mask_embedding"] = w(h)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="session")
def tiny_dflash_dir(tmp_path_factory) -> Path:
    return write_tiny_dflash(tmp_path_factory.mktemp("tiny_dflash"))


@pytest.fixture(scope="session")
def tiny_engines(tmp_path_factory, tiny_target_dir, tiny_dflash_dir) -> Path:
    """An engines/ folder exported from the tiny pair (ref_keys 64 keeps validation shapes small)."""
    from export.pipeline import ExportConfig, run_export

    out = tmp_path_factory.mktemp("engines") / "engines"
    run_export(ExportConfig(target_precision="fp32", family="dflash", out=out, checkpoint=tiny_dflash_dir, target=str(tiny_target_dir),
                            ref_keys=64))
    return out


@pytest.fixture(scope="session")
def tiny_int4_engines(tmp_path_factory, tiny_target_dir, tiny_dflash_dir) -> Path:
    """The tiny pair with an int4 target built by ONNX Runtime GenAI's model builder (kv_io "shared")."""
    pytest.importorskip("onnxruntime_genai")
    from export.pipeline import ExportConfig, run_export

    out = tmp_path_factory.mktemp("int4") / "engines"
    run_export(ExportConfig(family="dflash", out=out, checkpoint=tiny_dflash_dir, target=str(tiny_target_dir),
                            ref_keys=64, target_precision="int4"))
    return out


@pytest.fixture(scope="session")
def concat_engines(tmp_path_factory, tiny_target_dir, tiny_dflash_dir) -> Path:
    """The tiny pair exported in the former form: concat-KV target and drafter graphs (present = past + new)."""
    from export.pipeline import ExportConfig, run_export

    out = tmp_path_factory.mktemp("concat") / "engines"
    run_export(ExportConfig(target_precision="fp32", family="dflash", out=out, checkpoint=tiny_dflash_dir, target=str(tiny_target_dir),
                            ref_keys=64, target_kv_io="concat", drafter_kv_io="concat"))
    return out


def write_tiny_pard(path: Path, target_dir: Path, *, seed: int = 2, query_scale: dict | None = None) -> Path:
    """A tiny PARD drafter in sharpdraft's demo layout (2 layers initialised from the tiny target's first two,
    target embedding borrowed, ``pard_token`` = vocab_size with a ``mask_embedding``)."""
    from safetensors.torch import load_file, save_file

    tcfg = json.loads((target_dir / "config.json").read_text())
    cfg = {k: tcfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size")}
    for rope in ("rope_parameters", "rope_theta"):  # transformers 5 writes rope_parameters
        if rope in tcfg:
            cfg[rope] = tcfg[rope]
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=2, tie_word_embeddings=True,
               pard_token=tcfg["vocab_size"], spd_type="pard", sharpdraft_embeddings="target")
    if query_scale is not None:
        cfg["sharpdraft_query_scale"] = query_scale
    src = load_file(target_dir / "model.safetensors")
    state = {k: v.clone() for k, v in src.items() if k.startswith(("model.layers.0.", "model.layers.1."))}
    state["model.norm.weight"] = src["model.norm.weight"].clone()
    g = torch.Generator().manual_seed(seed)
    state["mask_embedding"] = torch.randn(cfg["hidden_size"], generator=g) * 0.2
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="session")
def tiny_pard_dir(tmp_path_factory, tiny_target_dir) -> Path:
    return write_tiny_pard(tmp_path_factory.mktemp("tiny_pard"), tiny_target_dir)


@pytest.fixture(scope="session")
def tiny_pard_engines(tmp_path_factory, tiny_target_dir, tiny_pard_dir) -> Path:
    """An engines/ folder exported from the tiny target + tiny PARD drafter (ref_keys 64, K = 4)."""
    from export.pipeline import ExportConfig, run_export

    out = tmp_path_factory.mktemp("pard_engines") / "engines"
    run_export(ExportConfig(target_precision="fp32", family="pard", out=out, checkpoint=tiny_pard_dir, target=str(tiny_target_dir),
                            ref_keys=64, num_draft_tokens=4))
    return out


def write_tiny_eagle3(path: Path, target_dir: Path, *, draft_vocab: int = 4096, seed: int = 3) -> Path:
    """A tiny EAGLE-3 drafter for the tiny target in the official layout (``midlayer.*``, d2t/t2d, no embedding:
    the target's is borrowed), taps ``eagle_aux_hidden_state_layer_ids`` [1, 2, 3], rope_theta absent (10000)."""
    from safetensors.torch import save_file

    tcfg = json.loads((target_dir / "config.json").read_text())
    h, hd, nh, nkv = tcfg["hidden_size"], tcfg["head_dim"], tcfg["num_attention_heads"], tcfg["num_key_value_heads"]
    inter, vocab = tcfg["intermediate_size"], tcfg["vocab_size"]
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
           "intermediate_size": inter, "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": hd,
           "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "vocab_size": vocab, "draft_vocab_size": draft_vocab,
           "target_hidden_size": h, "max_position_embeddings": 4096,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3], "use_aux_hidden_state": True}}
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    p = "midlayer."
    state = {"fc.weight": w(h, 3 * h), "norm.weight": 1 + w(h), "lm_head.weight": w(draft_vocab, h) * 5,
             p + "self_attn.q_proj.weight": w(nh * hd, 2 * h), p + "self_attn.k_proj.weight": w(nkv * hd, 2 * h),
             p + "self_attn.v_proj.weight": w(nkv * hd, 2 * h), p + "self_attn.o_proj.weight": w(h, nh * hd),
             p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
             p + "mlp.down_proj.weight": w(h, inter), p + "input_layernorm.weight": 1 + w(h),
             p + "hidden_norm.weight": 1 + w(h), p + "post_attention_layernorm.weight": 1 + w(h)}
    ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    state["d2t"] = ids - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    state["t2d"] = t2d
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="session")
def tiny_eagle3_dir(tmp_path_factory, tiny_target_dir) -> Path:
    return write_tiny_eagle3(tmp_path_factory.mktemp("tiny_eagle3"), tiny_target_dir)


@pytest.fixture(scope="session")
def tiny_eagle3_engines(tmp_path_factory, tiny_target_dir, tiny_eagle3_dir) -> Path:
    """An engines/ folder exported from the tiny target + tiny EAGLE-3 drafter (ref_keys 64, K = 4)."""
    from export.pipeline import ExportConfig, run_export

    out = tmp_path_factory.mktemp("eagle3_engines") / "engines"
    run_export(ExportConfig(target_precision="fp32", family="eagle3", out=out, checkpoint=tiny_eagle3_dir, target=str(tiny_target_dir),
                            ref_keys=64, num_draft_tokens=4))
    return out
