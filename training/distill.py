"""Self-distilled training corpus from the *served* target graph: token files that last, features recomputed.

Drafters are trained on the target's own greedy chain. This script runs the target an engines/ folder serves (the
default: ONNX Runtime GenAI's int4 builder graph, kv_io "shared"), so labels and features come from the target
users actually run, not from the fp32 model the GGUF dequantizes to.

``generate`` continuously batches greedy decoding over training prompts (instruction conversations from
training/corpus.py, some with a follow-up turn, and document continuations at long context) and writes two things:

- token shards under ``--corpus`` (committed: ids only, a few MB): ``shard_NNNNN.safetensors`` with ``ids`` uint16
  (all sequences concatenated), ``offsets`` int64 [n + 1], ``prompt_lens`` int32 [n], and metadata naming each
  sequence's source; ``manifest.json`` says how every shard was made (target graph, settings, seconds, tokens);
- feature shards under ``--features`` (build outputs, never committed) in training/shards.py's format:
  per sequence ``ids`` int32 [S], ``taps`` bf16 [S, len(taps) * hidden] (the target's ``aux_hidden_states``, i.e.
  hidden_states[id + 1]), ``labels`` int32 [S] (the target's argmax at each position), ``prompt_len`` (where
  the target's own greedy continuation starts) and, with ``--topk K`` (default 32), the target's K largest logits
  per position, ``top_ids`` int32 [S, K] and ``top_logits`` fp16 [S, K] (soft targets for distillation), taken
  from the same
  graph calls that generated the tokens, so features cost nothing extra.

``features`` recomputes feature shards from committed token shards with one teacher-forced pass of the served
target per sequence (a later session, another machine, or a new target graph: no token-by-token regeneration).

Decoding is greedy on the graph's 1-token path for generation; the teacher-forced ``features`` pass runs blocks, as
the speculative loop's verify does. On an int8-activation graph the two can resolve a near-tie differently, which
changes which continuation is stored, never the label at a position (labels are the graph's argmax there).

  python scripts/distill.py generate --engine runs/eng_int4 --minutes 50
  python scripts/distill.py features --engine runs/eng_int4 --features runs/distill/data
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click
import numpy as np
import torch

from runtime.backends.ort import OrtTarget, bind_shared, run_shared
from training import shards
from training.corpus import documents, instruction_conversations
from training.shards import read_token_shard, write_token_shard

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DEFAULT_CORPUS = Path("corpora/smollm2-135m-int4")
SHARD_SEQS = 32


def work_items(seed: int, doc_frac: float, tok, seq_len: int, new_tokens: int) -> list[dict]:
    """The deterministic list of generation items: chat conversations and document continuations.

    Each item is ``{"id": int, "source": str, "user": [messages]}`` (chat, rendered with the chat template) or
    ``{"id", "source", "prompt": [ids]}`` (a train-split document window of a random length in
    64 .. ``seq_len - new_tokens``: the target's greedy chain after long contexts). ``doc_frac`` of the items are
    documents. Item ids are stable for a given seed, so a rerun skips what the manifest lists as done.
    """
    rng = random.Random(seed)
    convs = instruction_conversations(seed)
    docs = documents("train")
    names = [f"doc{i}" for i in range(len(docs))]
    n_docs = int(len(convs) * doc_frac / max(1e-9, 1 - doc_frac))
    items: list[dict] = []
    for c in convs:
        items.append({"source": c["source"], "user": c["user"]})
    doc_ids = [None] * len(docs)
    for _ in range(n_docs):
        d = rng.randrange(len(docs))
        if doc_ids[d] is None:
            doc_ids[d] = tok.encode(docs[d])
        ids = doc_ids[d]
        n = rng.randrange(64, seq_len - new_tokens + 1)
        o = rng.randrange(0, max(1, len(ids) - n + 1))
        items.append({"source": f"document:{names[d]}@{o}", "prompt": ids[o:o + n]})
    rng.shuffle(items)
    for i, it in enumerate(items):
        it["id"] = i
    return items


def load_served_target(engine_dir: Path, threads: int) -> tuple[OrtTarget, "PreTrainedTokenizerBase"]:
    """The target graph of an engines/ folder (manifest and checksums checked) and its tokenizer; the drafter graph
    and its borrowed tables are not loaded.

    Raises:
        runtime.manifest.EngineDirError: the folder is incomplete or does not match its manifest.
    """
    from transformers import AutoTokenizer

    from runtime.manifest import load_manifest

    manifest = load_manifest(engine_dir)
    tok = AutoTokenizer.from_pretrained(engine_dir / manifest.tokenizer.dir)
    return OrtTarget(engine_dir, manifest, threads=threads), tok


class BatchDecoder:
    """Continuous greedy batching on a kv_io "shared" target graph (export/genai_target.py).

    K/V live in per-layer buffers ``[slots, kv_heads, capacity, head_dim]``. A new sequence is prefilled into its
    slot (one call on the slot's row view), then all slots decode together, one token per call, with a right-padded
    ``attention_mask`` whose row sums are the rows' lengths (the graph's positions and cache offsets). Logits and
    taps of every call are kept per row, so each finished sequence comes with its features and labels.
    """

    def __init__(self, target: OrtTarget, slots: int, capacity: int, topk: int = 0):
        if not target.shared_kv:
            raise click.UsageError("distill.py drives the quantized (kv_io shared) target; export with "
                                   "--target-precision int4 or int8")
        self.t, self.slots, self.cap, self.topk = target, slots, capacity, topk
        shape = (slots, target.kv_heads, capacity, target.head_dim)
        self.buffers = [np.zeros(shape, target.kv_dtype) for _ in target.kv_names]
        self.binding = bind_shared(target.session, self.buffers, target.kv_names, target.present_names,
                                   target.taps_output)
        self.rows: list[dict | None] = [None] * slots

    def prefill(self, slot: int, row: dict, prompt: list[int]) -> None:
        views = [b[slot: slot + 1] for b in self.buffers]
        logits, taps = run_shared(self.t.session, np.asarray([prompt], np.int64),
                                  np.ones((1, len(prompt)), np.int64), views, self.t.kv_names,
                                  self.t.present_names, self.t.taps_output)
        row.update(ids=list(prompt), labels=logits[0].argmax(-1).tolist(),
                   taps=[torch.from_numpy(taps[0]).to(torch.bfloat16)], prompt_len=len(prompt))
        if self.topk:
            row["top"] = [top_logits(logits[0], self.topk)]
        self.rows[slot] = row

    def step(self) -> None:
        """One decode call over all occupied slots: feeds each row's last label as its next token."""
        live = [i for i, r in enumerate(self.rows) if r is not None]
        lens = [len(r["ids"]) if r is not None else 0 for r in self.rows]
        width = max(lens) + 1
        ids = np.zeros((self.slots, 1), np.int64)
        mask = np.zeros((self.slots, width), np.int64)
        for i in range(self.slots):
            r = self.rows[i]
            ids[i, 0] = r["labels"][-1] if r is not None else 0
            mask[i, : lens[i] + 1] = 1  # an empty slot writes position 0 of its own row only
        logits, taps = run_shared(self.t.session, ids, mask, self.buffers, self.t.kv_names, self.t.present_names,
                                  self.t.taps_output, binding=self.binding)
        nxt = logits[:, 0].argmax(-1)
        for i in live:
            r = self.rows[i]
            r["ids"].append(int(ids[i, 0]))
            r["labels"].append(int(nxt[i]))
            r["taps"].append(torch.from_numpy(taps[i]).to(torch.bfloat16))
        if self.topk:
            top = top_logits(logits[live, 0], self.topk)
            for j, i in enumerate(live):
                self.rows[i]["top"].append((top[0][j: j + 1], top[1][j: j + 1]))


def top_logits(logits: np.ndarray, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest logits per row, as soft targets for distillation (DistillSpec, arXiv 2310.08461, trains on
    the target's distribution rather than its argmax alone).

    Args:
        logits: float32 ``[rows, vocab]`` from the target graph.
        k: how many to keep, 1 <= k <= vocab.
    Returns:
        ``(values, ids)``: float16 ``[rows, k]`` and int32 ``[rows, k]``, values in descending order.
    """
    v, i = torch.from_numpy(np.ascontiguousarray(logits, np.float32)).topk(k, dim=-1)
    return v.to(torch.float16), i.to(torch.int32)


def _record(row: dict) -> dict:
    rec = {"ids": torch.tensor(row["ids"], dtype=torch.int32),
           "labels": torch.tensor(row["labels"], dtype=torch.int32), "taps": torch.cat(row["taps"]),
           "prompt_len": row["prompt_len"]}
    if row.get("top"):
        rec["top_logits"] = torch.cat([t[0] for t in row["top"]])
        rec["top_ids"] = torch.cat([t[1] for t in row["top"]])
    return rec


def _manifest(corpus: Path) -> dict:
    f = corpus / "manifest.json"
    return json.loads(f.read_text()) if f.exists() else {"format": "sharpdraft token corpus v1", "shards": []}


def _write_manifest(corpus: Path, man: dict) -> None:
    tmp = corpus / ".manifest.json.tmp"
    tmp.write_text(json.dumps(man, indent=1) + "\n")
    tmp.replace(corpus / "manifest.json")


def generate(engine_dir: Path, corpus: Path, feat_dir: Path, minutes: float, slots: int, seed: int, doc_frac: float,
             seq_len: int, new_tokens: int, topk: int, threads: int):
    """Greedy-decode training items with the served target; append token and feature shards (resumable)."""
    target, tok = load_served_target(engine_dir, threads)
    eos = tok.eos_token_id
    corpus.mkdir(parents=True, exist_ok=True)
    feat_dir.mkdir(parents=True, exist_ok=True)
    man = _manifest(corpus)
    settings = {"seed": seed, "doc_frac": doc_frac, "seq_len": seq_len, "new_tokens": new_tokens}
    build = json.loads((engine_dir / "target" / "BUILD.json").read_text()) if (
        engine_dir / "target" / "BUILD.json").exists() else {}
    done = {i for s in man["shards"] if s["settings"] == settings for i in s["items"]}
    items = [it for it in work_items(seed, doc_frac, tok, seq_len, new_tokens) if it["id"] not in done]
    print(f"{len(items)} items to go ({len(done)} done for these settings)", flush=True)
    dec = BatchDecoder(target, slots, seq_len + 8, topk)
    queue = list(reversed(items))
    finished: list[tuple[dict, dict]] = []  # (item, row)
    shard = len(man["shards"])
    t0 = time.time()
    gen_tokens = 0

    def chat_ids(msgs: list[dict]) -> list[int]:
        return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)

    def start(slot: int, item: dict, msgs: list[dict] | None = None) -> None:
        if "prompt" in item:
            prompt = item["prompt"]
        else:
            msgs = msgs or [{"role": "user", "content": item["user"][0]}]
            prompt = chat_ids(msgs)[-(seq_len - new_tokens):]
        dec.prefill(slot, {"item": item, "msgs": msgs, "turn": 1 if msgs is None else len(msgs) // 2 + 1}, prompt)

    def flush(final: bool) -> None:
        nonlocal shard, finished
        while len(finished) >= SHARD_SEQS or (final and finished):
            batch, finished = finished[:SHARD_SEQS], finished[SHARD_SEQS:]
            name = f"shard_{shard:05d}"
            seqs = [r["ids"] + [r["labels"][-1]] for _, r in batch]
            write_token_shard(corpus / f"{name}.safetensors", seqs, [r["prompt_len"] for _, r in batch],
                              [it["source"] for it, _ in batch], [it["id"] for it, _ in batch])
            recs = [_record(r) for _, r in batch]
            shards.write_feature_shard(feat_dir / f"{name}.pt", "distill-int4", seq_len, recs)
            items_done = sorted({it["id"] for it, r in batch if r.get("last_turn", True)})
            man["shards"].append({"file": f"{name}.safetensors", "settings": settings, "items": items_done,
                                  "sequences": len(seqs), "tokens": int(sum(len(s) for s in seqs)),
                                  "generated_tokens": int(sum(len(s) - r["prompt_len"] for s, (_, r) in
                                                              zip(seqs, batch))),
                                  "seconds": round(time.time() - t0, 1), "target": build,
                                  "engine": str(engine_dir), "made_by": "scripts/distill.py generate"})
            _write_manifest(corpus, man)
            shard += 1
            print(f"{name}: {len(seqs)} sequences, {gen_tokens} tokens generated in {time.time() - t0:.0f}s "
                  f"({gen_tokens / (time.time() - t0):.0f}/s)", flush=True)

    while time.time() - t0 < minutes * 60 and (queue or any(dec.rows)):
        for s in range(slots):
            if dec.rows[s] is None and queue:
                start(s, queue.pop())
        dec.step()
        gen_tokens += sum(r is not None for r in dec.rows)
        for s, r in enumerate(dec.rows):
            if r is None:
                continue
            n_new = len(r["ids"]) + 1 - r["prompt_len"]
            if r["labels"][-1] == eos or n_new >= new_tokens or len(r["ids"]) + 1 >= seq_len:
                dec.rows[s] = None
                item = r["item"]
                users = item.get("user", [])
                if r["turn"] < len(users):  # follow-up turn after the target's own reply
                    reply = tok.decode(r["ids"][r["prompt_len"]:] + [r["labels"][-1]], skip_special_tokens=True)
                    msgs = (r["msgs"] or [{"role": "user", "content": users[0]}]) + [
                        {"role": "assistant", "content": reply}, {"role": "user", "content": users[r["turn"]]}]
                    r["last_turn"] = False
                    finished.append((item, r))
                    start(s, item, msgs)
                else:
                    finished.append((item, r))
        flush(False)
    flush(True)  # in-flight rows are dropped: their items run again on the next call


def features(engine_dir: Path, corpus: Path, feat_dir: Path, topk: int, threads: int):
    """Recompute feature shards from the token shards: one teacher-forced target pass per sequence (skips shards
    whose features exist)."""
    target, _ = load_served_target(engine_dir, threads)
    feat_dir.mkdir(parents=True, exist_ok=True)
    for f in shards.token_shard_files(corpus):
        out = feat_dir / f"{f.name.split('.')[0]}.pt"
        if out.exists():
            continue
        t0 = time.time()
        seqs, plens, _ = read_token_shard(f)
        recs = []
        for s, pl in zip(seqs, plens):
            cache = target.new_cache()
            ids = s[:-1]
            row = {"ids": ids, "labels": [], "taps": [], "top": [], "prompt_len": pl}
            for i in range(0, len(ids), target.prefill_chunk):
                lg, tp = target.forward([cache], [ids[i:i + target.prefill_chunk]])
                n = len(ids[i:i + target.prefill_chunk])
                row["labels"] += lg[0, :n].argmax(-1).tolist()
                row["taps"].append(torch.from_numpy(tp[0, :n]).to(torch.bfloat16))
                if topk:
                    row["top"].append(top_logits(lg[0, :n], topk))
            recs.append(_record(row))
        shards.write_feature_shard(out, "distill-int4", max(len(s) for s in seqs), recs)
        print(f"{out}: {len(recs)} sequences, {sum(len(s) for s in seqs)} tokens, {time.time() - t0:.0f}s",
              flush=True)
