"""Text <-> tokens for the HTTP layer: chat templates and per-token bytes for logprobs.

Routes render and tokenize prompts through `ModelState.render` / `.encode`
(api/generate.py), which run these off the event loop, on worker threads:
a 3 MB prompt takes seconds, and every stream would wait for it. The workers
only encode, with the tokenizer's settings never changed, which is what the
Hugging Face tokenizer needs to be shared between threads and with the
detokenizer on the event loop (its "Already borrowed" error comes from
changing truncation or padding while another thread encodes).
"""

from __future__ import annotations

import re
from functools import lru_cache

from mlxserve.api.errors import APIError, bad_request
from mlxserve.models.chat import PromptTooLong, encode_text, render_chat

# logprob for a token that cannot be sampled at all; JSON has no -Infinity, and
# OpenAI reports such tokens as -9999.0 too.
MIN_LOGPROB = -9999.0
# apply_chat_template arguments the server itself sets (or that change what it returns).
RESERVED_TEMPLATE_KWARGS = {"conversation", "tools", "tokenize", "return_dict", "return_tensors",
                            "padding", "truncation", "max_length"}
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def render(tokenizer, messages: list[dict], *, tools=None, chat_template_kwargs=None,
           continue_final: bool = False, param: str = "messages", token_limit: int | None = None) -> list[int]:
    """Token ids of a conversation in the model's own chat template.

    A template that refuses the conversation (most raise on roles out of
    order) is the client's mistake, so it becomes a 400 with the template's message.
    A prompt that cannot have fewer than `token_limit` tokens is refused before it is tokenized.
    """
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise bad_request(f"chat_template_kwargs: {', '.join(reserved)} cannot be set here",
                          "chat_template_kwargs")
    if continue_final:  # Anthropic's prefill: the reply continues the last assistant turn
        kwargs["continue_final_message"] = True
    add_generation_prompt = bool(kwargs.pop("add_generation_prompt", not continue_final))
    try:
        return render_chat(tokenizer, messages, tools=tools, chat_template_kwargs=kwargs,
                           add_generation_prompt=add_generation_prompt, token_limit=token_limit)
    except PromptTooLong as e:
        raise too_long(e, param) from None
    except ValueError as e:
        raise bad_request(f"{param}: {e}", param=param) from None
    except Exception as e:  # noqa: BLE001 - jinja2's TemplateError and friends
        raise bad_request(f"{param}: the model's chat template cannot render this "
                          f"conversation: {e}", param=param) from None


def encode(tokenizer, text: str, *, param: str = "prompt", token_limit: int | None = None) -> list[int]:
    """A plain prompt's token ids; refused as `render` refuses one that cannot fit."""
    try:
        return encode_text(tokenizer, text, token_limit)
    except PromptTooLong as e:
        raise too_long(e, param) from None


def too_long(e: PromptTooLong, param: str) -> APIError:
    return APIError(400, str(e), param=param, code="context_length_exceeded")


def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2 and its heirs such as Qwen and Llama 3).

    Printable Latin-1 bytes stand for themselves; the other 68 bytes are shifted
    to code points from 256 on, in byte order, so that every byte has a visible
    character. Inverting it turns a token's string back into its raw bytes.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return {c: b for b, c in chars.items()}


class TokenBytes:
    """The exact bytes of each token, for OpenAI's `bytes` and legacy `tokens` fields.

    Decoding a token alone loses bytes of a character split across tokens; the
    vocabulary string does not (byte-level BPE and SentencePiece byte fallback).
    """

    def __init__(self, tokenizer):
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        self._hf = hf
        decoder = getattr(getattr(hf, "backend_tokenizer", None), "decoder", None)
        self._byte_level = "ByteLevel" in repr(decoder)
        self._alphabet = _byte_level_alphabet()
        # Added tokens (specials, <tool_call>, ...) are stored as plain text, not byte-mapped.
        added = getattr(hf, "get_added_vocab", dict)()
        self._literal = set(added.values()) | set(getattr(hf, "all_special_ids", []) or [])
        self.bytes = lru_cache(maxsize=1 << 16)(self._bytes)

    def _bytes(self, token_id: int) -> bytes:
        piece = self._hf.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if token_id in self._literal:
            return piece.encode()
        if self._byte_level and all(c in self._alphabet for c in piece):
            return bytes(self._alphabet[c] for c in piece)
        m = _BYTE_TOKEN.match(piece)
        if m:  # SentencePiece byte fallback
            return bytes([int(m.group(1), 16)])
        return self._hf.decode([token_id]).encode()

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="replace")


def clamp(logprob: float | None) -> float:
    if logprob is None or logprob != logprob or logprob < MIN_LOGPROB:
        return MIN_LOGPROB
    return float(logprob)
