"""Stop conditions of one request, applied token by token to every block the loop emits.

Policy (vLLM's, written down once):
- a stop token (EOS unless ``ignore_eos``, or one of ``stop_token_ids``) ends generation; it is returned in the
  token ids and counted in usage, and its text is not shown (special tokens are skipped when decoding);
- a stop string ends generation at the token whose text completes it; that token is returned and counted, and the
  text is cut right before the stop string;
- ``max_new_tokens`` ends generation with finish_reason "length";
- whichever comes first in token order decides finish_reason; a token that is both a stop and the last allowed one
  ends with "stop". Tokens after the end are never kept: the loop truncates the caches to the returned tokens.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from runtime.sampling import SamplingParams


@dataclasses.dataclass(slots=True)
class StopChecker:
    """Applies a request's stop conditions to its generated tokens.

    Args:
        params: the request's parameters (max_new_tokens, stop_token_ids, stop, ignore_eos).
        eos_token_ids: the tokenizer's EOS ids.
        tokenizer: a HF tokenizer; needed only when ``params.stop`` is not empty.
    Raises:
        ValueError: stop strings without a tokenizer.
    """

    params: SamplingParams
    eos_token_ids: frozenset[int]
    tokenizer: Any = None
    stop_ids: frozenset[int] = dataclasses.field(init=False)
    text_end: int | None = dataclasses.field(init=False, default=None)  # cut position of a matched stop string

    def __post_init__(self) -> None:
        ids = set(self.params.stop_token_ids)
        if not self.params.ignore_eos:
            ids |= set(self.eos_token_ids)
        self.stop_ids = frozenset(ids)
        if self.params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; pass stop_token_ids instead")

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def extend(self, out: list[int], new: list[int]) -> str | None:
        """Append ``new`` to ``out`` token by token until a stop or the length limit.

        Args:
            out: tokens generated so far (modified in place; it never holds a stop: generation ends on one).
            new: candidate tokens of this round (accepted drafts + the target's token).
        Returns:
            finish_reason ("stop" / "length") when generation ended, else None. Example: out=[5], new=[7, 2, 9],
            EOS {2}, max 10 -> out [5, 7, 2], "stop"; max 2 -> out [5, 7], "length".
        """
        longest = max((len(s) for s in self.params.stop), default=0)
        # a token decodes to >= 1 byte and a character is <= 4 bytes: this many tail tokens cover any stop string
        window = 4 * longest + 8
        for tok in new:
            out.append(tok)
            if tok in self.stop_ids:
                return "stop"
            if self.params.stop:
                tail = self.decode(out[-window:])
                if any(s in tail for s in self.params.stop):
                    # earlier text was stop-free when it was checked: the first occurrence is this one
                    text = self.decode(out)
                    self.text_end = min(i for i in (text.find(s) for s in self.params.stop) if i >= 0)
                    return "stop"
            if len(out) >= self.params.max_new_tokens:
                return "length"
        return None

    def text(self, out: list[int]) -> str:
        """The returned text of ``out``: special tokens skipped, cut before a matched stop string."""
        text = self.decode(out)
        return text if self.text_end is None else text[: self.text_end]


class TextDeltas:
    """Streaming text of one request: :meth:`delta` returns the new text since the last call.

    Concatenated deltas equal :meth:`StopChecker.text` of the finished output: a trailing incomplete multi-byte
    character (decoded as U+FFFD) is held back until the token that completes it arrives, and while stop strings are
    set the last ``len(longest stop) - 1`` characters are held back, since they may turn out to start a stop string.

    Args:
        tokenizer: the HF tokenizer (same decoding as :class:`StopChecker`).
        stop: the request's stop strings.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent = ""

    def delta(self, token_ids: list[int], final_text: str | None = None) -> str:
        """New text after ``token_ids`` (all generated ids so far); pass ``final_text`` on the last call."""
        if final_text is not None:
            full = final_text
        else:
            full = self.tokenizer.decode(token_ids, skip_special_tokens=True).rstrip("\ufffd")
            if self.hold:
                full = full[: max(0, len(full) - self.hold)]
        if len(full) <= len(self.sent) or not full.startswith(self.sent):
            return ""
        out, self.sent = full[len(self.sent):], full
        return out
