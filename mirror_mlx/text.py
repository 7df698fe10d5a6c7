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
        hold = max((_overlap(buf, s) for s in self.stop), default=0)
        out, self.held = buf[: len(buf) - hold], buf[len(buf) - hold :]
        self.text += out
        return out


def _overlap(text: str, stop: str) -> int:
    """Length of the longest end of `text` that is a proper start of `stop`."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
