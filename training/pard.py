"""Train the demo PARD drafter for SmolLM2-135M-Instruct on this CPU (resumable, offline data only).

PARD (AMD, arXiv 2504.18583; docs/reference/drafters.md §2, §6.2) is an ordinary causal LM drafter fine-tuned
so that ONE forward over ``[committed..., last real token, pard_token x (K-1)]`` (contiguous positions, ordinary
causal mask) yields K draft tokens from the last K rows. Training (a paraphrase of ``pard_train.py``): the sequence
is replicated; copy c >= 1 holds the mask id at the same position ids; a custom mask lets copy c at position p see
real tokens 0..p-c plus the chain of mask tokens of copies 1..c at positions p-c+1..p (exactly p+1 keys, as at
inference); the label of every copy at position p is the prediction of token p+1. COD keeps the mask copies with
ratio 0.7^c (floor 0.2).

Here: K = 8 (7 mask copies), sequences of at most 512 tokens, reusing the DFlash feature shards under
``runs/dflash/data`` (only their token ids and target argmax labels; the tapped features are ignored), split into
train/validation by the hash of the token ids of every recipe (training/shards.py). Labels are the
target's argmax at each position (``--labels argmax``, the default; on self-distilled continuations this is the
next token itself) or the real next token (``--labels tokens``, PARD's original).

COD is implemented per *anchor* (last real token a): one uniform u_a per anchor, copy c of anchor a (the row at
position a+c) is kept iff u_a < max(0.7^c, 0.2). The kept sets are nested, so every kept row's chain of earlier
mask tokens is present, and the per-copy keep ratio is 0.7^c floored at 0.2.

Drafter: 2 Llama decoder layers with SmolLM2's geometry, initialised from two of the target's layers and its final
norm; embedding / LM head = the target's tied table (frozen, not stored); SmolLM2 has no spare id, so
``pard_token`` = 49152 = vocab_size and slots holding it are embedded with a learned ``mask_embedding`` [576].

  python scripts/train_pard.py train --minutes 55          # resumable: rerun to continue
  python scripts/train_pard.py save --out drafters/pard-smollm2-135m
  python scripts/train_pard.py validate [--drafter drafters/pard-smollm2-135m]
"""
from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from training import shards
from training.autocast import compute_dtype, cpu_autocast
from training.metrics import accept_len

SEQ_LEN = 512
K = 8  # drafts per forward: the last real token's row + K-1 mask rows
COPIES = K - 1
COD_RATIO, COD_FLOOR = 0.7, 0.2
QUERY_SCALE = {"ref_keys": SEQ_LEN, "top_k": 32, "slope": 5.0, "cap": math.exp(0.5), "enabled": True}


# ----------------------------------------------------------------------------------------------- layout / mask
def cod_depths(length: int, rng: random.Random, ratio: float = COD_RATIO, floor: float = COD_FLOOR,
               copies: int = COPIES) -> torch.Tensor:
    """Number of mask copies kept for each anchor a in 0..length-1 (nested COD: copy c kept iff u_a < max(r^c, f))."""
    out = []
    for _ in range(length):
        u = rng.random()
        out.append(sum(1 for c in range(1, copies + 1) if u < max(ratio ** c, floor)))
    return torch.tensor(out, dtype=torch.long)


def pard_layout(length: int, depth: torch.Tensor) -> dict[str, torch.Tensor]:
    """Rows of one PARD training forward and its attention mask.

    Rows: the real copy (positions 0..length-1), then for c = 1..max depth the mask rows of copy c for every anchor
    a with depth[a] >= c and a + c <= length - 1 (position a + c). Each row carries its ``anchor`` (last real token
    it may see: p for real rows, a for mask rows) and ``copy`` (0 for real rows).
    ``allowed[i, j]`` (bool, True = may attend): real key j with anchor_j <= anchor_i, or mask key j of the same
    anchor with copy_j <= copy_i. So copy c at position p sees real tokens 0..p-c and the mask chain of copies 1..c
    at positions p-c+1..p: exactly p+1 keys, the layout of inference. The label row of every row is its position
    (label at p = prediction of token p+1).

    Example: length 3, depth [2, 1, 0] -> rows (pos, anchor, copy): (0,0,0) (1,1,0) (2,2,0) (1,0,1) (2,1,1) (2,0,2);
    row (2,0,2) sees real 0 and mask rows (1,0,1), (2,0,2).
    """
    anchors, copies = [torch.arange(length)], [torch.zeros(length, dtype=torch.long)]
    for c in range(1, int(depth.max().item()) + 1 if length else 1):
        a = torch.nonzero((depth >= c) & (torch.arange(length) + c <= length - 1)).flatten()
        anchors.append(a)
        copies.append(torch.full_like(a, c))
    anchor, copy = torch.cat(anchors), torch.cat(copies)
    pos = anchor + copy
    real_key = (copy == 0)[None, :] & (anchor[None, :] <= anchor[:, None])
    mask_key = (copy > 0)[None, :] & (anchor[None, :] == anchor[:, None]) & (copy[None, :] <= copy[:, None])
    return {"pos": pos, "anchor": anchor, "copy": copy, "allowed": real_key | mask_key}


# ----------------------------------------------------------------------------------------------- model
def drafter_config(target_config, num_layers: int = 2):
    """HF LlamaConfig of the drafter: the target's geometry with ``num_layers`` layers (tied, vocab 49152)."""
    from transformers import LlamaConfig

    d = target_config.to_dict()
    for key in ("_name_or_path", "_model_name_or_path", "transformers_version", "dtype", "torch_dtype",
                "architectures", "model_type"):
        d.pop(key, None)
    d.update(num_hidden_layers=num_layers, max_position_embeddings=8192, tie_word_embeddings=True,
             vocab_size=target_config.vocab_size, architectures=["LlamaForCausalLM"])
    return LlamaConfig(**d)


class PardTrainingModel(nn.Module):
    """The PARD drafter as training builds it: HF Llama decoder layers + final norm + ``mask_embedding``; the
    embedding / LM head table is passed in. Saved as a PARD checkpoint that :func:`runtime.models.pard.load_pard`
    loads into the runtime's :class:`runtime.models.pard.PardDrafter`.

    State-dict keys are the HF ones (``model.layers.{i}.*``, ``model.norm.weight``) plus ``mask_embedding``.
    """

    def __init__(self, config):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

        config._attn_implementation = "sdpa"
        self.config = config
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.model.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary = LlamaRotaryEmbedding(config)
        self.mask_embedding = nn.Parameter(torch.zeros(config.hidden_size))
        self.pard_token = config.vocab_size

    def embed(self, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Embed ids [..., T]; ids == pard_token (vocab_size) take ``mask_embedding``."""
        is_mask = ids == self.pard_token
        h = F.embedding(ids.clamp(max=table.shape[0] - 1), table)
        return torch.where(is_mask[..., None], self.mask_embedding.to(h.dtype), h)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, allowed: torch.Tensor | None, table: torch.Tensor):
        """Final-normed hidden states [1, T, H] for ids/pos [1, T] under bool mask ``allowed`` [T, T] (None: causal)."""
        h = self.embed(ids, table)
        if allowed is None:
            allowed = torch.ones(ids.shape[-1], ids.shape[-1], dtype=torch.bool).tril()
        cos_sin = self.rotary(h, pos)
        mask = allowed[None, None]
        for layer in self.model.layers:
            h = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
        return self.model.norm(h)


def init_from_target(d: PardTrainingModel, target, layer_ids: list[int]) -> None:
    with torch.no_grad():
        tl = target.model.layers
        for layer, src in zip(d.model.layers, [tl[i] for i in layer_ids]):
            layer.load_state_dict(src.state_dict())
        d.model.norm.weight.copy_(target.model.norm.weight)
        d.mask_embedding.copy_(target.model.embed_tokens.weight.mean(0))


# ----------------------------------------------------------------------------------------------- loss
def pard_forward(d: PardTrainingModel, ids: torch.Tensor, labels: torch.Tensor, depth: torch.Tensor, table: torch.Tensor,
                 lm_head: torch.Tensor) -> dict:
    """One dense masked forward of (real copy + kept mask copies) of one sequence.

    ids/labels [L] (label at p = prediction of token p+1; entries < 0 are ignored), depth [L] mask copies per
    anchor. Returns per-row CE, correctness, and the layout.
    """
    lay = pard_layout(ids.numel(), depth)
    row_ids = torch.where(lay["copy"] == 0, ids[lay["pos"]], torch.full_like(lay["pos"], d.pard_token))
    h = d(row_ids[None], lay["pos"][None], lay["allowed"], table)[0]
    logits = (h.to(lm_head.dtype) @ lm_head.T).float()
    tgt = labels[lay["pos"]]
    valid = tgt >= 0
    ce = F.cross_entropy(logits, tgt.clamp(min=0), reduction="none") * valid
    correct = (logits.argmax(-1) == tgt) & valid
    return {"ce": ce, "correct": correct, "valid": valid, **lay}


def slot_table(out: dict, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[A, K] correctness / validity of draft j+1 (copy j at position a+j) for each anchor a in ``anchors``."""
    n = int(out["anchor"].max().item()) + 1
    idx = torch.full((n, K), -1, dtype=torch.long)
    idx[out["anchor"], out["copy"]] = torch.arange(out["anchor"].numel())
    sel = idx[anchors]
    present = sel >= 0
    g = sel.clamp(min=0)
    return out["correct"][g] & present, out["valid"][g] & present


# ----------------------------------------------------------------------------------------------- data
def load_sequences(work: Path, src: Path, val_every: int = shards.VAL_EVERY, corpus: Path | None = None,
                   max_len: int = SEQ_LEN) -> tuple[list[dict], list[dict]]:
    """Token ids + labels of every sequence, split by the hash of the ids (training/shards.py, the split of every
    recipe), each cut to its last ``max_len`` tokens (where a self-distilled sequence keeps the target's own
    continuation).

    Sources: the DFlash feature shards under ``src/data`` (ids and the target's argmax labels; the tapped features
    are not kept), or with ``corpus`` a token corpus (``corpora/smollm2-135m-int4``: ids only, written by
    scripts/distill.py), whose labels are the next tokens of the target's own greedy continuation (its argmax;
    the prompt's positions carry -100 and are not trained on). Cached in ``work/sequences.pt`` (ids and labels only).
    """
    cache = work / "sequences.pt"
    files = shards.token_shard_files(corpus) if corpus is not None else shards.feature_shard_files(src / "data")
    key = {"shards": [f.name for f in files], "max_len": max_len}
    if cache.exists():
        c = torch.load(cache)
        if c["shards"] == key["shards"] and c.get("max_len", SEQ_LEN) == max_len:
            return c["train"], c["val"]
    train_recs, val_recs = [], []

    def add(ids: torch.Tensor, labels: torch.Tensor, kind: str) -> None:
        if ids.numel() < shards.MIN_TOKENS:
            return
        rec = {"ids": ids[-max_len:].clone(), "labels": labels[-max_len:].clone(), "kind": kind}
        (val_recs if shards.is_validation(ids, val_every) else train_recs).append(rec)

    for f in files:
        if corpus is not None:
            seqs, prompt_lens, _ = shards.read_token_shard(f)
            for seq, plen in zip(seqs, prompt_lens):
                t = torch.tensor(seq, dtype=torch.int32)
                labels = t[1:].clone()
                labels[: max(int(plen) - 1, 0)] = -100  # prompt text: not the target's choice, not trained on
                add(t[:-1], labels, "corpus")
            continue
        s = shards.read_feature_shard(f)
        for r in s["records"]:
            add(r["ids"], r["labels"], s["kind"])
        del s
    work.mkdir(parents=True, exist_ok=True)
    torch.save({**key, "train": train_recs, "val": val_recs}, cache)
    return train_recs, val_recs


def rec_labels(rec: dict, mode: str) -> torch.Tensor:
    if mode == "argmax":
        return rec["labels"].long()
    ids = rec["ids"].long()
    return torch.cat([ids[1:], torch.tensor([-100])])


# ----------------------------------------------------------------------------------------------- validation
@torch.no_grad()
def validate_recs(d: PardTrainingModel, recs: list[dict], table, lm_head, labels_mode: str = "argmax",
                  anchors_per_seq: int = 48, seed: int = 1) -> dict:
    """Teacher-forced validation: per sequence, ``anchors_per_seq`` random anchors get all K-1 mask copies.

    val_loss: CE over all rows (real copy + those mask rows); val_loss_real / val_loss_mask split it;
    val_proxy_mal: 1 + leading run of correct drafts among K = 8 (mean over anchors, then sequences);
    val_proxy_mal7: the same over the first 7 drafts (comparable with the DFlash card's block-8 proxy);
    val_slot_acc: accuracy of drafts 1..K.
    """
    d.eval()
    rng = random.Random(seed)
    losses, lr_, lm_, mals, mals7, slots = [], [], [], [], [], []
    for rec in recs:
        ids, labels = rec["ids"].long(), rec_labels(rec, labels_mode)
        n = ids.numel()
        # anchors whose K labels all exist (ignored prompt positions excluded)
        cand = (labels >= 0).unfold(0, K, 1).all(1).nonzero().flatten().tolist() if n >= K else []
        if not cand:
            continue
        a = torch.tensor(sorted(rng.sample(cand, min(anchors_per_seq, len(cand)))))
        depth = torch.zeros(n, dtype=torch.long)
        depth[a] = COPIES
        with cpu_autocast():
            out = pard_forward(d, ids, labels, depth, table, lm_head)
        v = out["valid"].float()
        real = (out["copy"] == 0).float() * v
        losses.append((out["ce"].sum() / v.sum()).item())
        lr_.append((out["ce"] * real).sum().item() / real.sum().item())
        lm_.append((out["ce"] * (v - real)).sum().item() / (v - real).sum().clamp(min=1).item())
        correct, valid = slot_table(out, a)
        mals.append(accept_len(correct).float().mean().item())
        mals7.append(accept_len(correct[:, :K - 1]).float().mean().item())
        slots.append(correct.float().sum(0) / valid.float().sum(0).clamp(min=1))
    m = len(losses)
    return {"val_loss": round(sum(losses) / m, 4), "val_loss_real": round(sum(lr_) / m, 4),
            "val_loss_mask": round(sum(lm_) / m, 4), "val_proxy_mal": round(sum(mals) / m, 4),
            "val_proxy_mal7": round(sum(mals7) / m, 4),
            "val_slot_acc": [round(x, 3) for x in torch.stack(slots).mean(0).tolist()], "val_seqs": m}


# ----------------------------------------------------------------------------------------------- CLI


def _target_tables():
    from runtime.models.target import load_target

    target, _ = load_target()
    table = target.model.embed_tokens.weight.detach()
    lm_head = target.lm_head.weight.detach().to(compute_dtype())
    return target, table, lm_head


def _write_log(work: Path, state: dict, extra: dict | None = None) -> None:
    (work / "training_log.json").write_text(json.dumps({**(extra or {}), **state}, indent=1))


def train(work: Path, src: Path, minutes: float, init_mode: str, labels_mode: str, lr: float, warmup: int,
          seqs_per_step: int, trial_steps: int, save_minutes: float, val_seqs: int, threads: int,
          corpus: Path | None, max_len: int, init_from: Path | None):
    """Train (or resume) the drafter for --minutes of wall time; checkpoints under --work."""
    t_call = time.time()
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    work.mkdir(parents=True, exist_ok=True)
    target, table, lm_head = _target_tables()
    train_recs, val_recs = load_sequences(work, src, corpus=corpus, max_len=max_len)
    ntok = sum(r["ids"].numel() for r in train_recs)
    print(f"{len(train_recs)} train sequences, {ntok} tokens; {len(val_recs)} validation sequences "
          f"({time.time() - t_call:.0f}s)", flush=True)
    val_sub = val_recs[:val_seqs]
    ckpt_path = work / "ckpt.pt"
    cfg = drafter_config(target.config)
    nl = len(target.model.layers)
    choices = {"first": [0, 1], "last": [nl - 2, nl - 1]}
    budget = minutes * 60 - (time.time() - t_call)

    def lr_at(step: int, sec: float, total: float) -> float:
        warm = min(1.0, (step + 1) / warmup)
        return warm * (0.1 * lr + 0.9 * lr * 0.5 * (1 + math.cos(math.pi * min(sec / total, 1.0))))

    def step_once(d, opt, rng, state, cur_lr, run):
        d.train()
        for g in opt.param_groups:
            g["lr"] = cur_lr
        opt.zero_grad()
        for _ in range(seqs_per_step):
            rec = train_recs[rng.randrange(len(train_recs))]
            ids, labels = rec["ids"].long(), rec_labels(rec, state["labels"])
            depth = cod_depths(ids.numel(), rng)
            with cpu_autocast():
                out = pard_forward(d, ids, labels, depth, table, lm_head)
            v = out["valid"].float()
            loss = out["ce"].sum() / v.sum()
            (loss / seqs_per_step).backward()
            mv = v * (out["copy"] > 0)
            run["loss"] += loss.item()
            run["mask"] += (out["ce"] * mv).sum().item() / mv.sum().clamp(min=1).item()
            run["n"] += 1
            state["tokens"] += ids.numel()
            state["rows"] += out["pos"].numel()
        run["gn"] = float(torch.nn.utils.clip_grad_norm_(d.parameters(), 1.0))
        opt.step()
        state["step"] += 1

    def new_opt(d):
        return torch.optim.AdamW(d.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)

    t_start = time.time()
    if ckpt_path.exists():
        ck = torch.load(ckpt_path)
        d = PardTrainingModel(cfg)
        d.load_state_dict(ck["model"])
        state = ck["state"]
        opt = new_opt(d)
        opt.load_state_dict(ck["opt"])
        print(f"resumed at step {state['step']} ({state['seconds']:.0f}s trained)", flush=True)
    else:
        base = {"step": 0, "seconds": 0.0, "tokens": 0, "rows": 0, "log": [], "train_log": [],
                "labels": labels_mode, "lr": lr, "seqs_per_step": seqs_per_step, "init_eval": {},
                "data": str(corpus or src), "max_len": max(r["ids"].numel() for r in train_recs)}
        modes = ["first", "last"] if init_mode == "auto" else [init_mode]
        best = None
        if init_from is not None:
            modes = []
            d = load_pard_folder(init_from)
            best = (None, f"checkpoint {init_from}", d, new_opt(d), base)
        for m in modes:
            cand = PardTrainingModel(cfg)
            init_from_target(cand, target, choices[m])
            st = json.loads(json.dumps(base))
            o = new_opt(cand)
            if len(modes) > 1:
                # short trial from each init on the same sequences, then keep the lower validation loss
                v0 = validate_recs(cand, val_recs[:8], table, lm_head, labels_mode)
                rng_t, run = random.Random(1000), {"loss": 0.0, "mask": 0.0, "n": 0}
                t0 = time.time()
                for i in range(trial_steps):
                    step_once(cand, o, rng_t, st, lr_at(i, 0.0, 1.0), run)
                v = validate_recs(cand, val_recs[:8], table, lm_head, labels_mode)
                base["init_eval"][m] = {"layers": choices[m], "step0": v0, f"after_{trial_steps}_steps": v,
                                        "train_loss": round(run["loss"] / max(run["n"], 1), 4),
                                        "seconds": round(time.time() - t0)}
                print(f"init {m} {choices[m]}: {json.dumps(base['init_eval'][m])}", flush=True)
                if best is None or v["val_loss"] < best[0]:
                    best = (v["val_loss"], m, cand, o, st)
            else:
                best = (None, m, cand, o, st)
        _, init_name, d, opt, state = best
        state["init_eval"] = base["init_eval"]
        state["init"], state["init_layers"] = init_name, choices.get(init_name)
        print(f"init: {state['init']}" + (f" (target layers {state['init_layers']})" if state["init_layers"] else ""),
              flush=True)
    del target
    rng = random.Random(1000 + state["step"])
    total = state["seconds"] + budget

    def checkpoint():
        state["seconds"] += time.time() - t_start
        v = validate_recs(d, val_sub, table, lm_head, state["labels"])
        state["log"].append({"step": state["step"], "seconds": round(state["seconds"]), "tokens": state["tokens"],
                             **v})
        print("VAL", json.dumps(state["log"][-1]), flush=True)
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save({"model": d.state_dict(), "opt": opt.state_dict(), "state": state, "config": cfg.to_dict()}, tmp)
        tmp.replace(ckpt_path)
        _write_log(work, state)

    last_save = time.time()
    run = {"loss": 0.0, "mask": 0.0, "n": 0}
    while time.time() - t_call < minutes * 60 - 20:
        step_once(d, opt, rng, state, lr_at(state["step"], state["seconds"] + time.time() - t_start, total), run)
        if state["step"] % 10 == 0:
            el = state["seconds"] + time.time() - t_start
            rec_ = {"step": state["step"], "seconds": round(el), "loss": round(run["loss"] / run["n"], 4),
                    "loss_mask": round(run["mask"] / run["n"], 4), "lr": opt.param_groups[0]["lr"],
                    "grad_norm": round(run["gn"], 3)}
            state["train_log"].append(rec_)
            print("TRAIN", json.dumps(rec_), flush=True)
            run = {"loss": 0.0, "mask": 0.0, "n": 0}
        if time.time() - last_save > save_minutes * 60:
            checkpoint()
            t_start, last_save = time.time(), time.time()
    checkpoint()
    print(f"done: step {state['step']}, {state['seconds']:.0f}s trained", flush=True)


def _safetensors_dict(d: PardTrainingModel) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in d.state_dict().items()}


def drafter_config_json(cfg, ref_keys: int = SEQ_LEN) -> dict:
    """The saved config.json; ``ref_keys`` = the training length (the longest sequence trained on)."""
    c = cfg.to_dict()
    c.pop("_attn_implementation", None)
    c.update(architectures=["LlamaForCausalLM"], vocab_size=cfg.vocab_size, tie_word_embeddings=True,
             pard_token=cfg.vocab_size, spd_type="pard", sharpdraft_embeddings="target",
             sharpdraft_query_scale={**QUERY_SCALE, "ref_keys": int(ref_keys)})
    return c


def load_pard_folder(path: Path) -> PardTrainingModel:
    """Load a saved drafter folder (config.json + model.safetensors) into a float32 :class:`PardTrainingModel`."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    c = json.loads((path / "config.json").read_text())
    extra = {k: c.pop(k) for k in ("pard_token", "spd_type", "sharpdraft_embeddings", "sharpdraft_query_scale")}
    assert extra["pard_token"] == c["vocab_size"], extra
    d = PardTrainingModel(LlamaConfig(**c))
    d.load_state_dict({k: v.float() for k, v in load_file(path / "model.safetensors").items()}, strict=True)
    return d


def save(work: Path, out: Path):
    """Write config.json + model.safetensors (bf16, HF Llama keys + mask_embedding) + training_log.json."""
    from runtime.models.checkpoint_io import save_safetensors
    from transformers import LlamaConfig

    ck = torch.load(work / "ckpt.pt")
    cfg = LlamaConfig(**{k: v for k, v in ck["config"].items() if not k.startswith("_")})
    d = PardTrainingModel(cfg)
    d.load_state_dict(ck["model"])
    out.mkdir(parents=True, exist_ok=True)
    tensors = _safetensors_dict(d)
    save_safetensors(tensors, out / "model.safetensors", metadata={"format": "pt", "recipe": "scripts/train_pard.py"})
    (out / "config.json").write_text(json.dumps(drafter_config_json(cfg, ck["state"].get("max_len", SEQ_LEN)),
                                                indent=2) + "\n")
    kinds: dict[str, int] = {}
    if (work / "sequences.pt").exists():
        c = torch.load(work / "sequences.pt")
        for r in c["train"]:
            kinds[r["kind"]] = kinds.get(r["kind"], 0) + r["ids"].numel()
    (out / "training_log.json").write_text(json.dumps({"train_tokens_by_kind": kinds, **ck["state"]}, indent=1))
    size = (out / "model.safetensors").stat().st_size
    print(f"wrote {out} ({size / 1e6:.1f} MB, {sum(t.numel() for t in tensors.values()) / 1e6:.2f} M params)")


def validate_checkpoint(work: Path, src: Path, drafter: Path | None, max_seqs: int, labels_mode: str, threads: int):
    """Teacher-forced validation loss, proxy MAL and per-slot accuracy on the held-out (hash-split) sequences."""
    from transformers import LlamaConfig

    torch.set_num_threads(threads)
    target, table, lm_head = _target_tables()
    _, val_recs = load_sequences(work, src)
    if drafter is None:
        ck = torch.load(work / "ckpt.pt")
        d = PardTrainingModel(LlamaConfig(**{k: v for k, v in ck["config"].items() if not k.startswith("_")}))
        d.load_state_dict(ck["model"])
    else:
        d = load_pard_folder(drafter)
    recs = val_recs[:max_seqs] if max_seqs else val_recs
    print(json.dumps({"drafter": str(drafter or work / "ckpt.pt"), **validate_recs(d, recs, table, lm_head,
                                                                                  labels_mode)}))
