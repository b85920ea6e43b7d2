"""Incremental, UTF-8-safe detokenizing and stop strings.

Text is decoded over a short sliding window of tokens (prefix + new), the
approach of TGI and vLLM: a token whose bytes end mid-character decodes to
U+FFFD, so text is held back until the character is complete. Decoding the
window's prefix too keeps tokenizer-specific spacing (SentencePiece's leading
space, byte-fallback tokens) right, so the streamed pieces add up to the text
of the whole output.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


def fast_decode(tokenizer):
    """`ids -> text` with special tokens skipped, as `tokenizer.decode` gives it.

    A Hugging Face fast tokenizer without space clean-up decodes with its Rust backend
    and nothing else; calling that directly skips transformers' argument handling and
    mlx-lm's wrapper (a few microseconds per call, twice per streamed token, on the
    event loop that the MLX thread waits on for the GIL). Anything else keeps `decode`.
    """
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's TokenizerWrapper holds the HF one
    backend = getattr(hf, "backend_tokenizer", None)
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:  # pragma: no cover - transformers comes with mlx-lm
        PreTrainedTokenizerFast = None
    if (backend is not None and PreTrainedTokenizerFast is not None and isinstance(hf, PreTrainedTokenizerFast)
            and type(hf)._decode is PreTrainedTokenizerFast._decode
            and type(hf).decode is PreTrainedTokenizerFast.decode
            and getattr(hf, "clean_up_tokenization_spaces", True) is False):
        decode = backend.decode
        return lambda ids: decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, decode=None):
        """`decode`: `fast_decode(tokenizer)`, made once per tokenizer by callers that make many."""
        self._decode = decode or fast_decode(tokenizer)
        self.token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def add(self, token_ids: list[int]) -> str:
        """Add tokens; return the newly completed text."""
        self.token_ids.extend(token_ids)
        prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        text = self._decode(self.token_ids[self._prefix_offset :])
        if text.endswith(REPLACEMENT) or len(text) <= len(prefix):
            return ""  # an incomplete character, or nothing visible yet
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        return text[len(prefix) :]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the end)."""
        prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        text = self._decode(self.token_ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self.token_ids)
        return text[len(prefix) :] if len(text) > len(prefix) else ""


class StopStringMatcher:
    """Finds stop strings in streamed text, also across token boundaries.

    Text that could be the start of a stop string is held back until it is
    known not to be one, so a stop string never reaches the client.
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """Returns (text safe to emit, the stop string found or None)."""
        if not self.stops:
            return text, None
        text = self._pending + text
        found = None
        cut = len(text)
        for stop in self.stops:
            i = text.find(stop)
            if i != -1 and i < cut:
                cut, found = i, stop
        if found is not None:
            self._pending = ""
            return text[:cut], found
        keep = 0
        for k in range(min(self._hold, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                keep = k
                break
        self._pending = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], None

    def flush(self) -> str:
        text, self._pending = self._pending, ""
        return text
