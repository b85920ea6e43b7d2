"""A conversation rendered with the model's own chat template.

Below api/ (requests), multimodal/ (prompts with images), the offline `LLM` and the
benchmarks, which all render chats the same way.

An agent's prompt is the last one plus a little: tokenizing it whole each turn
(Claude Code's 56 kB, 11.7k tokens: 35 ms on a 2-core CPU, growing with the
session) is the largest host cost of a turn the prefix cache serves. So the
text is encoded from where it parts from a recent one, just after a special
token both share (`<|im_end|>`, `<|im_start|>`, ...): a fast tokenizer splits
the text at its added tokens before anything else, so the pieces on either side
tokenize the same apart as together, and the ids are those of encoding the
whole text. (Just before one would not do: the piece before it must end at the
same special token in both texts.)
"""

from __future__ import annotations

import bisect
import threading
import weakref
from collections import OrderedDict

from mlxserve.models.token_bound import fewest_tokens

RECENT = 16  # texts remembered per tokenizer (one per agent session, roughly)
MIN_REUSE = 4096  # characters: shorter shared prefixes are encoded again


class PromptTooLong(ValueError):
    """A prompt with more tokens than the limit, found before its ids are built: from its
    length alone (before tokenizing: seconds for a few MB), or from its encoding's length."""

    def __init__(self, count: int, limit: int, exact: bool = False):
        has = f"{count} tokens" if exact else f"at least {count} tokens (from its length)"
        super().__init__(f"This model's maximum context length is {limit} tokens, and the prompt has "
                         f"{has}: no room for output.")


def render_chat(tokenizer, messages: list[dict], *, tools=None, chat_template_kwargs=None,
                add_generation_prompt: bool = True, token_limit: int | None = None) -> list[int]:
    """Token ids of a conversation rendered with the model's own chat template.

    Raises PromptTooLong, without tokenizing, for a text that cannot have fewer
    than `token_limit` tokens."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model has no chat template; use a plain completion prompt")
    kwargs = dict(chat_template_kwargs or {})
    encoder = encoder_of(tokenizer)
    if encoder is None:  # not a Hugging Face tokenizer: its own template call tokenizes
        ids = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)
    text = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
    )
    check_length(encoder.hf, text, token_limit)
    return encoder.encode(text, token_limit)


def encode_text(tokenizer, text: str, token_limit: int | None = None) -> list[int]:
    """A plain prompt's token ids (with the tokenizer's own special tokens, a BOS where it adds
    one), refused as `render_chat` refuses one that cannot fit."""
    hf = hf_of(tokenizer)
    if hf is not None:
        check_length(hf, text, token_limit)
    return list(tokenizer.encode(text))


def check_length(hf, text: str, token_limit: int | None) -> None:
    if token_limit is None or len(text) < token_limit:  # too short to prove anything: skip the count
        return
    at_least = fewest_tokens(hf, text)
    if at_least is not None and at_least > token_limit:
        raise PromptTooLong(at_least, token_limit)


_ENCODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ENCODERS_LOCK = threading.Lock()


def hf_of(tokenizer):
    """The Hugging Face tokenizer under mlx-lm's wrapper, or None."""
    from transformers import PreTrainedTokenizerBase

    hf = tokenizer
    while not isinstance(hf, PreTrainedTokenizerBase) and hasattr(hf, "_tokenizer"):
        hf = hf._tokenizer  # mlx-lm's TokenizerWrapper -> the Hugging Face tokenizer
    return hf if isinstance(hf, PreTrainedTokenizerBase) else None


def encoder_of(tokenizer) -> "PrefixEncoder | None":
    """The PrefixEncoder of a Hugging Face tokenizer (under mlx-lm's wrapper), or None."""
    hf = hf_of(tokenizer)
    if hf is None:
        return None
    with _ENCODERS_LOCK:
        encoder = _ENCODERS.get(hf)
        if encoder is None:
            encoder = _ENCODERS[hf] = PrefixEncoder(hf)
        return encoder


class PrefixEncoder:
    """`hf.encode(text, add_special_tokens=False)`, reusing the ids of a recent text it extends."""

    def __init__(self, hf, check: bool = True):
        self.hf = hf
        # tokenizers.Tokenizer (Rust); None: a slow (Python) tokenizer, encoded whole
        self.fast = getattr(hf, "backend_tokenizer", None) if getattr(hf, "is_fast", False) else None
        self.cut_texts = self._cut_texts()  # {token's text: id}
        self.cut_ids = frozenset(self.cut_texts.values())
        self.recent: OrderedDict[str, tuple[list[int], list[int], list[int]]] = OrderedDict()
        self.lock = threading.Lock()
        if check and self.fast is not None and self.cut_ids and not self._agrees():
            self.fast = None  # e.g. a SentencePiece-style tokenizer marking each piece's start

    def _agrees(self) -> bool:
        """Whether cut texts encode as whole ones for this tokenizer: pieces after each cut token
        that start with a space, a letter, a newline or a digit, after a text past MIN_REUSE."""
        filler = "Some words, and then some more. " * (MIN_REUSE // 16)
        for token_id in sorted(self.cut_ids)[:4]:
            token = self.hf.convert_ids_to_tokens(token_id)
            for piece in (" hello", "hello", "\n\nhello", "12 apples"):
                first, second = filler + token + piece, filler + token + piece + token + piece
                probe = PrefixEncoder(self.hf, check=False)
                for text in (first, second):
                    if probe.encode(text) != list(self.fast.encode(text, add_special_tokens=False).ids):
                        return False
        return True

    def _cut_texts(self) -> dict[str, int]:
        """Added tokens a text may be cut just after, by their text: special, matched as written
        (no whitespace stripped around them, not normalized, not only as a whole word)."""
        decoder = getattr(self.hf, "added_tokens_decoder", None) or {}
        return {t.content: i for i, t in decoder.items()
                if getattr(t, "special", False) and not getattr(t, "lstrip", True)
                and not getattr(t, "rstrip", True) and not getattr(t, "normalized", True)
                and not getattr(t, "single_word", True)}

    def encode(self, text: str, token_limit: int | None = None) -> list[int]:
        """The ids; PromptTooLong, before they are built, if there are more than `token_limit`."""
        if self.fast is None or not self.cut_ids:
            return list(self.hf.encode(text, add_special_tokens=False))
        with self.lock:
            base = self._longest_shared(text)
        ids, chars, tokens = [], [], []
        start = 0
        if base is not None:
            shared, (old_ids, old_chars, old_tokens) = base
            j = bisect.bisect_right(old_chars, shared) - 1  # the last cut both texts share
            if j >= 0 and old_chars[j] >= MIN_REUSE:
                start = old_chars[j]
                ids, chars, tokens = old_ids[:old_tokens[j]], old_chars[:j + 1], old_tokens[:j + 1]
        # encode_batch, not encode: the Rust tokenizer lets go of the GIL only in the batch call,
        # and a 3 MB text holds it for seconds (the event loop and the engine would wait).
        encoding = self.fast.encode_batch([text[start:]], add_special_tokens=False)[0]
        offset = len(ids)
        if token_limit is not None and offset + len(encoding) > token_limit:
            raise PromptTooLong(offset + len(encoding), token_limit, exact=True)
        new_ids = encoding.ids
        # A cut just after each cut token: the characters and tokens before it, found by searching
        # the text and asking the encoding for those few tokens. (Every token's offsets as Python
        # objects would hold the GIL for 1.5 s for a 3 MB text, numpy over the ids for 100 ms.)
        for pos, k in self._cuts(text, start, encoding, new_ids):
            chars.append(pos)
            tokens.append(offset + k + 1)
        ids = ids + new_ids
        with self.lock:
            self.recent[text] = (ids, chars, tokens)
            self.recent.move_to_end(text)
            while len(self.recent) > RECENT:
                self.recent.popitem(last=False)
        return list(ids)

    def _cuts(self, text: str, start: int, encoding, new_ids) -> list[tuple[int, int]]:
        """(character just after, token index) of each cut token in `text[start:]`, in order."""
        found = []
        for content, token_id in self.cut_texts.items():
            pos = text.find(content, start)
            while pos >= 0:
                k = encoding.char_to_token(pos - start)
                if k is not None and new_ids[k] == token_id:
                    found.append((pos + len(content), k))
                pos = text.find(content, pos + len(content))
        return sorted(found)

    def _longest_shared(self, text: str):
        """(characters shared, entry) of the recent text sharing the longest prefix with `text`."""
        best = None
        for old, entry in reversed(self.recent.items()):
            if old[:MIN_REUSE] != text[:MIN_REUSE]:
                continue
            n = common_prefix_length(old, text)
            if best is None or n > best[0]:
                best = (n, entry)
        return best


def common_prefix_length(a, b) -> int:
    """Items (characters, token ids) `a` and `b` share at their start (binary search over slice
    comparisons, which run in C)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low
