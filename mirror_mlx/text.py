"""Token ids -> text, streamed: never splits a multi-byte character, never shows a stop string
or any text after it."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase


class TextStream:
    """`add(token)` returns the text that became final; `stopped` turns true when a stop string
    appears (the text before it is returned, the stop string and anything after are not)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.tables = [_prefix_table(s) for s in self.stop]
        self.ids: list[int] = []
        # Decode a short window of recent tokens, not the whole text: `prefix` is where the
        # window starts, `read` where the already-returned text ends.
        self.prefix = self.read = 0
        self.held = ""  # returned by the tokenizer, held back as a possible stop-string start
        self.stopped = False
        self.text = ""  # everything returned so far

    def add(self, token: int) -> str:
        if self.stopped:
            return ""
        self.ids.append(token)
        done = self._decode(self.prefix, self.read)
        now = self._decode(self.prefix, len(self.ids))
        if len(now) <= len(done) or now.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        self.prefix, self.read = self.read, len(self.ids)
        return self._release(now[len(done):])

    def flush(self) -> str:
        """At the end: whatever is left (an incomplete character is shown as U+FFFD)."""
        if self.stopped:
            return ""
        tail = self._decode(self.prefix, len(self.ids))[len(self._decode(self.prefix, self.read)):]
        self.read = len(self.ids)
        out, self.held = self.held + tail, ""
        self.text += out
        return out

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.ids[start:end], skip_special_tokens=False)

    def _release(self, new: str) -> str:
        buf = self.held + new
        hits = [at for at in (buf.find(s) for s in self.stop) if at >= 0]
        if hits:
            self.stopped = True
            buf, self.held = buf[: min(hits)], ""
            self.text += buf
            return buf
        hold = max((_overlap(buf, s, t) for s, t in zip(self.stop, self.tables)), default=0)
        out, self.held = buf[: len(buf) - hold], buf[len(buf) - hold :]
        self.text += out
        return out


def _prefix_table(stop: str) -> list[int]:
    """For each i, the length of the longest proper prefix of stop[:i + 1] that is also its
    suffix (Knuth-Morris-Pratt)."""
    table, k = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = table[k - 1]
        if stop[i] == stop[k]:
            k += 1
        table[i] = k
    return table


def _overlap(text: str, stop: str, table: list[int]) -> int:
    """Length of the longest end of `text` that is a proper start of `stop` (text holds no
    whole `stop`), in time linear in the stop's length: comparing every end with every start
    would be quadratic in it."""
    k = 0
    for ch in text[max(0, len(text) - len(stop) + 1) :] if len(stop) > 1 else "":
        if k == len(stop):
            k = table[k - 1]
        while k and stop[k] != ch:
            k = table[k - 1]
        if stop[k] == ch:
            k += 1
    return k if k < len(stop) else table[k - 1]
