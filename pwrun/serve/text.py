"""One choice's text as its tokens arrive: incremental detokenization and stop strings.

What it does: ``ChoiceText.feed`` takes the request's tokens so far and returns the text to send now. The
text is decoded from a few tokens before the new ones (a sliding window: about one short decode per token) and is
held back while it ends inside a multi-byte character (U+FFFD) or could still become a stop string; once a stop
string appears, the text ends just before it and ``stopped`` is set (the caller aborts the request).
The concatenated deltas equal ``tokenizer.decode(all tokens, skip_special_tokens=True)`` cut at the stop.
"""

from __future__ import annotations

from typing import Any

# tokens decoded before the new ones, so that a word-initial space or a merged character comes out as in a full
# decode (byte-level BPE and SentencePiece both need only a few)
_WINDOW = 6


class ChoiceText:
    """The text of one request's tokens, as deltas; ``stop``: strings that end it (excluded from the text)."""

    def __init__(self, tokenizer: Any, stop: list[str] | None = None) -> None:
        self.tok = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.text = ""  # decoded so far (may include held-back characters)
        self.sent = 0  # characters of ``text`` already returned
        self.prefix = 0  # token index where the decode window starts
        self.read = 0  # tokens whose text is in ``text``
        self.window: str | None = ""  # decode of tokens prefix..read (None: not decoded yet)
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=True))

    def feed(self, token_ids: tuple[int, ...] | list[int], final: bool = False) -> str:
        """The text to send for ``token_ids`` (every token of the request so far); ``final``: no more tokens come,
        send everything left."""
        if self.stopped:
            return ""
        ids = list(token_ids)
        if len(ids) > self.read:
            if self.window is None:
                self.window = self._decode(ids[self.prefix:self.read])
            after = self._decode(ids[self.prefix:])
            if not after.endswith("\ufffd") or final:
                if after.startswith(self.window):
                    self.text += after[len(self.window):]
                else:  # a tokenizer whose decode is not prefix-stable here: fall back to a full decode
                    self.text = self._decode(ids)
                self.read = len(ids)
                self.window = after
                if self.read - self.prefix > 2 * _WINDOW:  # slide the window now and then, not every token
                    self.prefix, self.window = self.read - _WINDOW, None
        return self._release(final)

    def _release(self, final: bool) -> str:
        start = max(self.sent - max((len(s) for s in self.stop), default=1), 0)
        for s in self.stop:
            at = self.text.find(s, start)
            if at != -1:
                self.text = self.text[:at]
                self.stopped = True
        if self.stopped:
            final = True
        hold = 0 if final else self._partial_stop()
        end = max(len(self.text) - hold, self.sent)
        out = self.text[self.sent:end]
        self.sent = end
        return out

    def _partial_stop(self) -> int:
        """Characters at the end of ``text`` that begin some stop string (held back until decided)."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best
