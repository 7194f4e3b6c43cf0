"""Train the demo EAGLE-3 drafter for SmolLM2-135M-Instruct on this CPU (resumable, offline data only).

Data: the DFlash run's feature shards under ``runs/dflash/data`` (see scripts/train_dflash.py ``data``): per sequence
(<= 512 tokens) the token ids, the target's argmax labels (labels[p] = the target's prediction of token p + 1) and the
tapped target features hidden_states[2], hidden_states[15], hidden_states[28] concatenated ([len, 3 * 576] bf16).
Nothing is recomputed. Train / validation split: the token-id hash split of every recipe (training/shards.py:
1 sequence in 40 is validation), so the drafters are validated on the same sequences.

Model: runtime/models/eagle3.py's Eagle3Drafter with the SmolLM2 geometry, a reduced draft vocabulary (the N most
frequent target labels of the training split), the target's embedding borrowed (frozen, not in the checkpoint).

Training ("training-time test", EAGLE-3 traineagle3/cnets.py in miniature; docs/reference/drafters.md §3.2):
  - step 0 (teacher-forced): drafter index t holds (token t + 1, fc(target features at t)) and predicts labels[t + 1];
  - step i >= 1: index t holds (labels[t + i], the drafter's own step-(i-1) output at t, pre-norm, no fc) and
    predicts labels[t + i + 1]; its query sees keys 0..t of step 0 plus the diagonal key (index t) of each of steps
    1..i; position ids are not advanced (the reference's layout);
  - CE over the draft vocabulary (labels outside it ignored), step i weighted 0.8 ** i.

  python scripts/train_eagle3.py train --minutes 45       # resumable: rerun to continue
  python scripts/train_eagle3.py save --out drafters/eagle3-smollm2-135m
"""
from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from runtime.models.layers import rope_cos_sin
from runtime.models.eagle3 import Eagle3Config, Eagle3Drafter, load_eagle3, save_eagle3
from training import shards
from training.autocast import cpu_autocast
from training.metrics import chain_accept

SEQ_LEN = 512
AUX_LAYER_IDS = [2, 15, 28]  # HF hidden_states indices stored in the DFlash shards (taps [1, 14, 27] + 1)
INIT_LAYER = 28  # target layer whose weights initialise the midlayer (its input is hidden_states[28] = 3rd tap)
STEP_DECAY = 0.8
WARMUP = 30  # optimiser steps
QUERY_SCALE = {"ref_keys": SEQ_LEN, "top_k": 32, "slope": 5.0, "cap": math.exp(0.5), "enabled": True}


# ----------------------------------------------------------------------------------------------- data
def load_shards(data_dir: Path, val_every: int = shards.VAL_EVERY, min_len: int = 8) -> tuple[list[dict], list[dict]]:
    """All records of the feature shards under ``data_dir`` with at least ``min_len`` tokens, split into
    ``(train, validation)`` by the hash of their token ids (training/shards.py, the split of every recipe)."""
    return shards.load_feature_split(data_dir, val_every, min_len)


def build_vocab(recs: list[dict], vocab_size: int, n: int) -> tuple[torch.Tensor, float]:
    """The n most frequent label ids of ``recs`` (sorted by target id, as EAGLE-3 does) and their label coverage."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for r in recs:
        counts += torch.bincount(r["labels"].long(), minlength=vocab_size)
    top = torch.topk(counts, n).indices
    ids = torch.sort(top).values
    return ids, counts[ids].sum().item() / counts.sum().item()


def vocab_buffers(draft_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d2t int64 [N] with target id = i + d2t[i], t2d bool [vocab], target->draft lookup int64 [vocab], -100 off)."""
    n = draft_ids.numel()
    d2t = draft_ids.long() - torch.arange(n)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids.long()] = True
    lookup = torch.full((vocab_size,), -100, dtype=torch.int64)
    lookup[draft_ids.long()] = torch.arange(n)
    return d2t, t2d, lookup


# ----------------------------------------------------------------------------------------------- TTT layout
def ttt_mask(length: int, step: int) -> torch.Tensor:
    """Bool ``[T, (step + 1) * T]``: keys visible to the queries of unrolled step ``step`` over T drafter indices.

    Key blocks are [step 0 | step 1 | ... | step ``step``], T keys each. Query t sees keys 0..t of step 0 (causal)
    and key t of every later block (the diagonal: its own chain ancestors, then itself). So it sees t + 1 + step keys,
    as a chain query at depth ``step`` does at inference.
    Example: T=3, step=1 -> [[T,F,F, T,F,F], [T,T,F, F,T,F], [T,T,T, F,F,T]].
    """
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    eye = torch.eye(length, dtype=torch.bool)
    return torch.cat([causal] + [eye] * step, dim=1)


def ttt_targets(ids: torch.Tensor, labels: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input tokens and target (target-vocabulary) ids per unrolled step over the T = n - 1 drafter indices.

    ids, labels ``[n]``: labels[p] = the target's argmax at p (its prediction of token p + 1).
    Returns (tokens ``[steps, T]``, targets ``[steps, T]``): step 0: tokens[0, t] = ids[t + 1],
    targets[0, t] = labels[t + 1]; step i: tokens[i, t] = labels[t + i], targets[i, t] = labels[t + i + 1].
    Indices past the sequence end get token 0 and target -100.
    """
    n = ids.numel()
    length = n - 1
    tokens = torch.zeros(steps, length, dtype=torch.int64)
    targets = torch.full((steps, length), -100, dtype=torch.int64)
    t = torch.arange(length)
    for i in range(steps):
        src_tok = t + i
        src_tgt = t + i + 1
        ok_tok = src_tok < n if i else torch.ones(length, dtype=torch.bool)
        ok_tgt = src_tgt < n
        if i == 0:
            tokens[0] = ids[1:].long()
        else:
            tokens[i, ok_tok] = labels[src_tok[ok_tok]].long()
        targets[i, ok_tgt] = labels[src_tgt[ok_tgt]].long()
    return tokens, targets


def ttt_forward(d: Eagle3Drafter, taps: torch.Tensor, tokens: torch.Tensor, embed: torch.Tensor,
                advance: bool = False) -> list:
    """Unrolled TTT forward of one sequence. taps ``[n, 3H]`` (only the first T = n - 1 used), tokens ``[steps, T]``.

    Uses Eagle3Drafter's own modules (fc, midlayer, norm, lm_head) exactly as its ``forward`` does, with the TTT mask
    in place of the plain causal one. Returns per step draft-vocabulary logits ``[T, N]``.
    advance=False: every step keeps position id t (the training layout). advance=True: step i at index t has position
    t + i, which is exactly chain drafting at inference (context 0..t, then i chain steps); used for evaluation.
    """
    cfg = d.config
    steps, length = tokens.shape
    layer = d.midlayer
    h = d.fc(taps[None, :length])  # [1, T, H]
    z = h.new_zeros(1, cfg.num_key_value_heads, 0, cfg.head_dim)
    pk, pv = z, z
    out_logits = []
    for i in range(steps):
        if i == 0 or advance:
            pos = torch.arange(length)[None] + (i if advance else 0)
            cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, h.dtype)
        emb = F.embedding(tokens[i][None], embed)
        x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(h)], dim=-1)
        add_mask = torch.where(ttt_mask(length, i), 0.0, torch.finfo(x.dtype).min).to(x.dtype)[None, None]
        attn, pk, pv = layer.self_attn(x, cos, sin, pk, pv, add_mask)
        hr = h + attn
        out = hr + layer.mlp(layer.post_attention_layernorm(hr))
        out_logits.append(d.lm_head(d.norm(out))[0].float())
        h = out  # recycled pre-norm output: next step's hidden
    return out_logits


def ttt_loss(d, rec, steps, embed, lookup, advance=False):
    """Weighted CE over the draft vocabulary and per-step correctness ``[steps, T]`` / validity masks."""
    tokens, targets = ttt_targets(rec["ids"], rec["labels"], steps)
    logits = ttt_forward(d, rec["taps"].float(), tokens, embed, advance)
    total, wsum, correct, valid = 0.0, 0.0, [], []
    for i, lg in enumerate(logits):
        tgt_t = targets[i]
        has = tgt_t >= 0
        tgt_d = torch.where(has, lookup[tgt_t.clamp(min=0)], -100)
        in_vocab = tgt_d >= 0
        if in_vocab.any():
            total = total + STEP_DECAY ** i * F.cross_entropy(lg, tgt_d, ignore_index=-100)
            wsum += STEP_DECAY ** i
        correct.append((lg.argmax(-1) == tgt_d) & in_vocab)
        valid.append(has)
    return total / max(wsum, 1e-9), torch.stack(correct), torch.stack(valid)


# ----------------------------------------------------------------------------------------------- model
def make_config(tc, draft_vocab: int) -> Eagle3Config:
    raw = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": tc.hidden_size, "intermediate_size": tc.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": tc.num_attention_heads, "num_key_value_heads": tc.num_key_value_heads,
        "head_dim": tc.hidden_size // tc.num_attention_heads, "rms_norm_eps": tc.rms_norm_eps,
        "rope_theta": 100000.0, "rope_scaling": None, "max_position_embeddings": tc.max_position_embeddings,
        "vocab_size": tc.vocab_size, "draft_vocab_size": draft_vocab, "target_hidden_size": tc.hidden_size,
        "attention_bias": False, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "pad_token_id": 2, "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_LAYER_IDS, "use_aux_hidden_state": True,
                         "use_input_layernorm_in_first_layer": True, "norm_before_residual": False},
        "sharpdraft_query_scale": QUERY_SCALE,
    }
    return Eagle3Config.from_dict(raw)


def make_drafter(target, draft_ids: torch.Tensor) -> Eagle3Drafter:
    """Eagle3Drafter initialised from the target (see the card for the reasons)."""
    tc = target.config
    cfg = make_config(tc, draft_ids.numel())
    d = Eagle3Drafter(cfg)
    h = tc.hidden_size
    src = target.model.layers[INIT_LAYER]
    d2t, t2d, _ = vocab_buffers(draft_ids, tc.vocab_size)
    with torch.no_grad():
        # fc: pick the third tap (hidden_states[28], the input of target layer 28) -> the midlayer starts as layer 28.
        d.fc.weight.zero_()
        d.fc.weight[:, 2 * h:3 * h].copy_(torch.eye(h))
        d.fc.weight[:, :2 * h].normal_(0.0, 0.02 / math.sqrt(2))  # small: lets the other taps in from step 1
        for name in ("q_proj", "k_proj", "v_proj"):
            w = getattr(d.midlayer.self_attn, name).weight
            w.zero_()  # embedding half [:, :H] starts at 0 (learned); hidden half = target layer 28
            w[:, h:].copy_(getattr(src.self_attn, name).weight)
        d.midlayer.self_attn.o_proj.weight.copy_(src.self_attn.o_proj.weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(d.midlayer.mlp, name).weight.copy_(getattr(src.mlp, name).weight)
        d.midlayer.hidden_norm.weight.copy_(src.input_layernorm.weight)
        d.midlayer.input_layernorm.weight.copy_(src.input_layernorm.weight)
        d.midlayer.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight)
        d.norm.weight.copy_(target.model.norm.weight)
        d.lm_head.weight.copy_(target.model.embed_tokens.weight[draft_ids.long()])
        d.d2t.copy_(d2t)
        d.t2d.copy_(t2d)
    return d


def init_drafter(path: Path, target, draft_ids: torch.Tensor) -> Eagle3Drafter:
    """An earlier EAGLE-3 checkpoint re-targeted to a new draft vocabulary ``draft_ids`` (int64 ``[N]``, sorted target
    ids): fc, midlayer and norm are kept; an LM-head row is the old trained row where the token was in the old
    vocabulary, else zero (logit 0 until trained: the target's embedding rows, :func:`make_drafter`'s start, outscore
    the trained rows; measured on the int4 distill shards, first-step accuracy 0.03 with them, 0.26 with zeros).

    Raises:
        CheckpointError: the folder does not load strictly (runtime/models/eagle3.py ``load_eagle3``).
    """
    old = load_eagle3(path)
    tc = target.config
    d = Eagle3Drafter(make_config(tc, draft_ids.numel()))
    state = {k: v for k, v in old.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    missing, unexpected = d.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight", "d2t", "t2d"}:
        raise ValueError(f"{path}: does not match this recipe's EAGLE-3 layout (missing {missing}, unexpected "
                         f"{unexpected}); start from the target instead (drop --init-from)")
    d2t, t2d, _ = vocab_buffers(draft_ids, tc.vocab_size)
    old_row = vocab_buffers(old.draft_to_target, tc.vocab_size)[2]  # target id -> old draft row (-100: absent)
    with torch.no_grad():
        rows = old_row[draft_ids.long()]
        head = torch.zeros_like(d.lm_head.weight)
        head[rows >= 0] = old.lm_head.weight[rows[rows >= 0]].to(head.dtype)
        d.lm_head.weight.copy_(head)
        d.d2t.copy_(d2t)
        d.t2d.copy_(t2d)
    return d


# ----------------------------------------------------------------------------------------------- CLI


def train(data_dir: Path, work: Path, minutes: float, draft_vocab: int, ttt_steps: int, val_steps: int, lr: float,
          seqs_per_step: int, save_minutes: float, max_steps: int, val_every: int, threads: int,
          init_from: Path | None):
    """Train (or resume) on the feature shards for --minutes of wall time; checkpoint + validate every few minutes."""
    from runtime.models.target import load_target

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    work.mkdir(parents=True, exist_ok=True)
    train_recs, val_recs = load_shards(data_dir, val_every)
    ntok = sum(r["ids"].numel() for r in train_recs)
    print(f"{len(train_recs)} train sequences, {ntok} tokens; {len(val_recs)} validation sequences", flush=True)
    target, _ = load_target()
    embed = target.model.embed_tokens.weight.detach().clone()
    ckpt_path = work / "ckpt.pt"
    if ckpt_path.exists():
        ck = torch.load(ckpt_path)
        d = Eagle3Drafter(Eagle3Config.from_dict(ck["config"]))
        d.load_state_dict(ck["model"])
        draft_ids = ck["draft_ids"]
        state = ck["state"]
    else:
        draft_ids, cov = build_vocab(train_recs, target.config.vocab_size, draft_vocab)
        lookup0 = vocab_buffers(draft_ids, target.config.vocab_size)[2]
        vl = torch.cat([r["labels"].long() for r in val_recs])
        val_cov = (lookup0[vl] >= 0).float().mean().item()
        d = make_drafter(target, draft_ids) if init_from is None else init_drafter(init_from, target, draft_ids)
        # the query-scale profile's ref_keys is the training length (the longest sequence), as for DFlash
        longest = max(r["ids"].numel() for r in train_recs)
        if d.config.raw.get("sharpdraft_query_scale"):
            d.config.raw["sharpdraft_query_scale"] = {**d.config.raw["sharpdraft_query_scale"], "ref_keys": longest}
            d.config.query_scale = d.config.raw["sharpdraft_query_scale"]
        state = {"step": 0, "seconds": 0.0, "log": [], "train_tokens": ntok, "train_seqs": len(train_recs),
                 "val_seqs": len(val_recs), "draft_vocab": draft_vocab, "label_coverage_train": round(cov, 4),
                 "label_coverage_val": round(val_cov, 4), "ttt_steps": ttt_steps, "val_steps": val_steps,
                 "lr": lr, "seqs_per_step": seqs_per_step, "sessions": [], "data": str(data_dir),
                 "init_from": str(init_from) if init_from else f"target layer {INIT_LAYER}",
                 "longest_sequence": longest}
        print(f"draft vocab {draft_vocab}: covers {cov:.4f} of train labels, {val_cov:.4f} of val labels", flush=True)
    del target
    lookup = vocab_buffers(draft_ids, d.config.vocab_size)[2]
    params = [p for p in d.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    if ckpt_path.exists():
        opt.load_state_dict(ck["opt"])
        print(f"resumed at step {state['step']} ({state['seconds']:.0f}s trained)", flush=True)
        del ck
    state["sessions"].append({"start_step": state["step"], "minutes": minutes})
    rng = random.Random(1000 + state["step"])
    call_start, budget = time.time(), minutes * 60  # wall clock of this call (validation included)
    total = state["seconds"] + budget  # cosine horizon in training seconds
    last_save = time.time()
    if state["step"] == 0 and not state["log"]:
        _log_val(d, state, val_recs, val_steps, embed, lookup, work, loss=None)

    def lr_at(sec: float) -> float:
        warm = min(1.0, (state["step"] + 1) / WARMUP)
        return warm * (0.1 * lr + 0.9 * lr * 0.5 * (1 + math.cos(math.pi * min(sec / total, 1.0))))

    recent: list[float] = []
    recent_acc: list[torch.Tensor] = []
    done = 0
    while time.time() - call_start < budget and not (max_steps and done >= max_steps):
        t0 = time.time()
        d.train()
        for g in opt.param_groups:
            g["lr"] = lr_at(state["seconds"])
        opt.zero_grad()
        step_loss = 0.0
        for _ in range(seqs_per_step):
            rec = train_recs[rng.randrange(len(train_recs))]
            with cpu_autocast():
                loss, correct, valid = ttt_loss(d, rec, ttt_steps, embed, lookup)
            (loss / seqs_per_step).backward()
            step_loss += loss.item() / seqs_per_step
            recent_acc.append(correct.float().sum(1) / valid.float().sum(1).clamp(min=1))
        gn = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        state["step"] += 1
        state["seconds"] += time.time() - t0
        done += 1
        recent.append(step_loss)
        if state["step"] % 10 == 0 or done <= 3:
            acc = torch.stack(recent_acc[-40:]).mean(0).tolist()
            print(f"step {state['step']} loss {sum(recent[-10:]) / len(recent[-10:]):.3f} acc "
                  f"{[round(a, 3) for a in acc]} gnorm {gn:.2f} lr {opt.param_groups[0]['lr']:.2e} "
                  f"{state['seconds']:.0f}s ({time.time() - t0:.1f}s/step)", flush=True)
        if time.time() - last_save > save_minutes * 60:
            _checkpoint(d, opt, state, draft_ids, ckpt_path)
            _log_val(d, state, val_recs, val_steps, embed, lookup, work, loss=sum(recent[-50:]) / len(recent[-50:]))
            _checkpoint(d, opt, state, draft_ids, ckpt_path)
            last_save = time.time()
    _log_val(d, state, val_recs, val_steps, embed, lookup, work,
             loss=sum(recent[-50:]) / max(len(recent[-50:]), 1) if recent else None)
    _checkpoint(d, opt, state, draft_ids, ckpt_path)
    print("done", flush=True)


@torch.no_grad()
def validate(d, val_recs, steps, embed, lookup, advance=False) -> dict:
    d.eval()
    losses, lens, corr, val = [], [], [], []
    for rec in val_recs:
        if rec["ids"].numel() < steps + 2:
            continue
        with cpu_autocast():
            loss, correct, valid = ttt_loss(d, rec, steps, embed, lookup, advance)
        losses.append(loss.item())
        lens.append(chain_accept(correct, valid).float())
        corr.append(correct.float().sum(1))
        val.append(valid.float().sum(1))
    acc = torch.stack(corr).sum(0) / torch.stack(val).sum(0)
    return {"val_loss": round(sum(losses) / len(losses), 4), "val_proxy_mal": round(torch.cat(lens).mean().item(), 4),
            "val_step_acc": [round(x, 4) for x in acc.tolist()]}


def _log_val(d, state, val_recs, steps, embed, lookup, work, loss):
    t = time.time()
    v = validate(d, val_recs, steps, embed, lookup)
    entry = {"step": state["step"], "seconds": round(state["seconds"]), "train_loss": loss and round(loss, 4), **v,
             "val_seconds": round(time.time() - t)}
    state["log"].append(entry)
    print("VAL", json.dumps(entry), flush=True)
    (work / "training_log.json").write_text(json.dumps(state, indent=1))


def _checkpoint(d, opt, state, draft_ids, ckpt_path):
    tmp = ckpt_path.with_suffix(".tmp")
    torch.save({"model": d.state_dict(), "opt": opt.state_dict(), "state": state, "config": d.config.to_dict(),
                "draft_ids": draft_ids}, tmp)
    tmp.replace(ckpt_path)


def evaluate(data_dir: Path, work: Path, steps: int, threads: int):
    """Validation proxy of the checkpoint in both layouts (positions held = training; advanced = chain inference)."""
    from runtime.models.target import load_target

    torch.set_num_threads(threads)
    ck = torch.load(work / "ckpt.pt")
    d = Eagle3Drafter(Eagle3Config.from_dict(ck["config"]))
    d.load_state_dict(ck["model"])
    _, val_recs = load_shards(data_dir)
    target, _ = load_target()
    embed = target.model.embed_tokens.weight.detach().clone()
    lookup = vocab_buffers(ck["draft_ids"], d.config.vocab_size)[2]
    res = {"step": ck["state"]["step"], "val_seqs": len(val_recs), "steps": steps}
    for name, adv in (("positions_held", False), ("positions_advanced", True)):
        res[name] = validate(d, val_recs, steps, embed, lookup, advance=adv)
        print(name, json.dumps(res[name]), flush=True)
    (work / "eval_val.json").write_text(json.dumps(res, indent=1))


def save(work: Path, out: Path):
    """Write the checkpoint in the official EAGLE-3 layout (bf16 safetensors) and check it loads strictly."""
    ck = torch.load(work / "ckpt.pt")
    config = ck["config"]
    d = Eagle3Drafter(Eagle3Config.from_dict(config))
    d.load_state_dict(ck["model"])
    save_eagle3(d, out, config, metadata={"format": "pt", "recipe": "scripts/train_eagle3.py"})
    (out / "training_log.json").write_text(json.dumps(ck["state"], indent=1))
    if (work / "eval_val.json").is_file():
        (out / "eval_val.json").write_text((work / "eval_val.json").read_text())
    back = load_eagle3(out)  # strict: raises on any key / shape / d2t mismatch
    assert torch.equal(back.d2t, d.d2t) and torch.equal(back.t2d, d.t2d)
    assert back.d2t.dtype == torch.int64 and back.t2d.dtype == torch.bool
    assert torch.equal(back.draft_to_target, ck["draft_ids"].long())
    ref = d.to(torch.bfloat16).float()
    for k, v in back.state_dict().items():
        assert torch.equal(v, ref.state_dict()[k]), k
    size = (out / "model.safetensors").stat().st_size
    print(f"wrote {out}: {size / 1e6:.1f} MB; load_eagle3 strict OK", flush=True)
