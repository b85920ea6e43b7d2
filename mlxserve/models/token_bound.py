"""The fewest tokens a text can encode to, known from its length alone, before tokenizing it.

A 3 MB prompt takes seconds to tokenize; if it cannot fit the context anyway, the
server can say so at once. No token covers more bytes of text than the longest
piece of the vocabulary, so a text of B bytes has at least B / longest tokens.
That holds only where the tokenizer cannot shrink the text first or fold an
unbounded run into one token: a byte-pair vocabulary whose unknown characters
are not fused, and normalizers that lengthen the text (prefixing, replacing a
space by "▁", decomposing) or shrink it by a bounded factor (composing: a Hangul
syllable from three jamo, at most 3x). Any other tokenizer gets no bound (None).
"""

from __future__ import annotations

import json
import threading
import weakref

# Normalizers a text's bytes shrink under by at most this factor; others (lowercasing
# special letters, stripping, NFKC's compatibility folds) give no bound.
_SHRINK = {"Sequence": 1, "Prepend": 1, "NFD": 1, "NFC": 3}
_BOUNDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def fewest_tokens(hf, text: str) -> int | None:
    """A lower bound on the tokens of `hf.encode(text, add_special_tokens=False)`, or None
    where the tokenizer gives none (`hf`: a Hugging Face tokenizer)."""
    per_token = bytes_per_token(hf)
    if per_token is None:
        return None
    return -(-len(text.encode("utf-8", errors="surrogatepass")) // per_token)


def bytes_per_token(hf) -> int | None:
    """The most bytes of text one token can stand for (computed once per tokenizer)."""
    with _LOCK:
        if hf not in _BOUNDS:
            _BOUNDS[hf] = _bytes_per_token(hf)
        return _BOUNDS[hf]


def _bytes_per_token(hf) -> int | None:
    backend = getattr(hf, "backend_tokenizer", None) if getattr(hf, "is_fast", False) else None
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or (model.get("fuse_unk") and not model.get("byte_fallback")):
        return None  # fused unknown characters: one token for a run of any length
    shrink = _shrink(spec.get("normalizer"))
    if shrink is None:
        return None
    byte_level = "ByteLevel" in json.dumps(spec.get("decoder"))
    longest = 4  # an unknown character: one token, at most 4 bytes of UTF-8
    for piece in model.get("vocab", {}):
        # Byte-level pieces spell each byte as one character; others write a space as "▁".
        size = len(piece) if byte_level else len(piece.replace("\u2581", " ").encode())
        longest = max(longest, size)
    for added in spec.get("added_tokens", []):
        longest = max(longest, len(added["content"].encode()))
    return longest * shrink


def _shrink(normalizer: dict | None) -> int | None:
    """How many times fewer bytes the normalizer can leave of a text (None: no bound)."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Replace":  # a fixed string by one at least as long only lengthens the text
        pattern = (normalizer.get("pattern") or {}).get("String")
        if pattern is None or len(normalizer.get("content", "").encode()) < len(pattern.encode()):
            return None
        return 1
    if kind not in _SHRINK:
        return None
    factor = _SHRINK[kind]
    for inner in normalizer.get("normalizers", []):
        inner_factor = _shrink(inner)
        if inner_factor is None:
            return None
        factor *= inner_factor
    return factor
