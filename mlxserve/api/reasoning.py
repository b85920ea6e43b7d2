"""A thinking model's reasoning, split from its answer.

Two syntaxes are known, found once from the tokenizer (`detect`):
- think tags (Qwen3/3.5, DeepSeek-R1, QwQ): `<think>reasoning</think>answer`, with
  the markers mlx-lm infers for the vocabulary. Many templates write `<think>` into
  the generation prompt, so the answer starts inside the reasoning and only the end
  tag is generated; `ReasoningSyntax.splitter` reads that from the prompt's tail.
- gpt-oss's harmony channels: `<|channel|>analysis<|message|>…<|end|><|start|>assistant
  <|channel|>final<|message|>…`; the analysis channel is the reasoning.

Markers that are special tokens never reach the text (the engine decodes with
`skip_special_tokens`), so a splitter is fed each output's token ids too and puts
such a marker back into the text from its id. Everything then works on text: a
marker split across pieces is held back until it is decided, so no half of one
ever reaches the answer.
"""

from __future__ import annotations

from dataclasses import dataclass

HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")
# The prompt's last tokens that decide where a generation starts (inside reasoning or not).
PROMPT_TAIL_TOKENS = 32


@dataclass
class ReasoningSyntax:
    kind: str  # "think" | "harmony"
    start: str  # think: "<think>"; harmony: "<|channel|>"
    end: str  # think: "</think>"; harmony: "<|end|>"
    special_ids: dict[int, str]  # marker tokens the engine's text leaves out, with their text
    tokenizer: object = None

    def opens_in_prompt(self, prompt_ids) -> bool:
        """True if the prompt leaves the reply inside reasoning (it ends with an open `<think>`)."""
        if self.kind != "think" or not prompt_ids:
            return False
        tail = self.tokenizer.decode(list(prompt_ids[-PROMPT_TAIL_TOKENS:]), skip_special_tokens=False)
        return tail.rfind(self.start) > tail.rfind(self.end)

    def splitter(self, prompt_ids=()) -> ReasoningSplitter:
        if self.kind == "harmony":
            return HarmonySplitter(self)
        return ThinkSplitter(self, self.opens_in_prompt(prompt_ids))

    @property
    def end_stop(self) -> tuple[list[str], list[int]]:
        """(stop strings, stop token ids) that end a generation where the reasoning ends."""
        ids = [i for i, text in self.special_ids.items() if text == self.end]
        return ([], ids) if ids else ([self.end], [])

    @property
    def close_text(self) -> str:
        """What ends reasoning cut off mid-way, so that the answer follows."""
        if self.kind == "harmony":
            return "<|end|><|start|>assistant<|channel|>final<|message|>"
        return f"\n{self.end}\n\n"


def detect(tokenizer) -> ReasoningSyntax | None:
    """The model's reasoning syntax, or None for a model that does not reason."""
    vocab = tokenizer.get_vocab()
    if all(m in vocab for m in HARMONY_MARKERS[:4]):
        markers = [m for m in HARMONY_MARKERS if m in vocab]
        kind, start, end = "harmony", "<|channel|>", "<|end|>"
    else:
        start, end = getattr(tokenizer, "think_start", None), getattr(tokenizer, "think_end", None)
        if not start or not end:
            return None
        markers, kind = [start, end], "think"
    return ReasoningSyntax(kind, start, end, _special_ids(tokenizer, markers), tokenizer)


def _special_ids(tokenizer, markers) -> dict[int, str]:
    """Tokens of the markers that decoding with skip_special_tokens drops, with their text."""
    out = {}
    for marker in markers:
        for token in tokenizer.encode(marker, add_special_tokens=False):
            if tokenizer.decode([token], skip_special_tokens=True) == "":
                out[token] = tokenizer.decode([token], skip_special_tokens=False)
    return out


def _partial(text: str, markers) -> int:
    """Length of the longest tail of `text` that is a proper start of a marker."""
    for n in range(min(max(map(len, markers)) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


class ReasoningSplitter:
    """Generated text in, (reasoning, content) deltas out; see `feed`."""

    def __init__(self, syntax: ReasoningSyntax):
        self.syntax = syntax
        self.buffer = ""

    def feed(self, text: str, token_ids=(), finished: bool = False) -> tuple[str, str]:
        """One output's (reasoning, content) to send now; `finished` flushes what is held."""
        for token in token_ids or ():
            marker = self.syntax.special_ids.get(token)
            if marker:  # one token per output: its own text is "", earlier held text comes first
                text += marker
        self.buffer += text
        reasoning, content = [], []
        self._scan(reasoning, content)
        if finished:
            self._flush(reasoning, content)
        return "".join(reasoning), "".join(content)

    def split(self, texts, token_ids=None) -> tuple[str, str]:
        """A whole answer as (reasoning, content): its text, or its outputs' texts and token ids."""
        if isinstance(texts, str):
            return self.feed(texts, finished=True)
        ids = [[t] for t in token_ids] if token_ids is not None and len(token_ids) == len(texts) else None
        parts = [self.feed(t, ids[k] if ids else ()) for k, t in enumerate(texts)]
        parts.append(self.feed("", finished=True))
        return "".join(r for r, _ in parts), "".join(c for _, c in parts)

    @property
    def in_reasoning(self) -> bool:
        raise NotImplementedError

    def _scan(self, reasoning: list, content: list) -> None:
        raise NotImplementedError

    def _flush(self, reasoning: list, content: list) -> None:
        raise NotImplementedError


class ThinkSplitter(ReasoningSplitter):
    """`<think>reasoning</think>answer`.

    States: "start" (the answer may still open with the start tag), "reasoning",
    "after" (the end tag was seen; the whitespace before the answer is dropped),
    "content" (everything from here on is the answer, as is). Whitespace around the
    reasoning is trimmed, held until it is known to be inside it.
    """

    def __init__(self, syntax: ReasoningSyntax, opened: bool):
        super().__init__(syntax)
        self.state = "reasoning" if opened else "start"
        self.began = False  # reasoning text sent yet (its leading whitespace is dropped)

    @property
    def in_reasoning(self) -> bool:
        return self.state == "reasoning"

    def _scan(self, reasoning, content):
        start, end = self.syntax.start, self.syntax.end
        while self.buffer:
            if self.state == "start":
                head = self.buffer.lstrip()
                if head.startswith(start):
                    self.buffer, self.state = head[len(start):], "reasoning"
                elif not head or start.startswith(head):
                    return  # could still be the start tag
                else:
                    self.state = "content"
            elif self.state == "reasoning":
                if not self.began:
                    self.buffer = self.buffer.lstrip()
                at = self.buffer.find(end)
                if at >= 0:
                    self._reason(self.buffer[:at].rstrip(), reasoning)
                    self.buffer, self.state = self.buffer[at + len(end):], "after"
                    continue
                body = self.buffer[: len(self.buffer) - _partial(self.buffer, [end])]
                text = body.rstrip()
                self._reason(text, reasoning)
                self.buffer = self.buffer[len(text):]
                return
            elif self.state == "after":
                self.buffer = self.buffer.lstrip()
                if self.buffer:
                    self.state = "content"
            else:
                content.append(self.buffer)
                self.buffer = ""

    def _reason(self, text, reasoning):
        if text:
            reasoning.append(text)
            self.began = True

    def _flush(self, reasoning, content):
        if self.state == "reasoning":  # cut off before the end tag: all of it was reasoning
            self._reason(self.buffer.strip() if not self.began else self.buffer.rstrip(), reasoning)
        elif self.state == "start":
            content.append(self.buffer)  # not a tag after all: the answer as it was
        self.buffer = ""


class HarmonySplitter(ReasoningSplitter):
    """gpt-oss's messages: `<|channel|>NAME<|message|>BODY<|end|>`, each after `<|start|>ROLE`.

    The analysis channel's bodies are the reasoning; every other channel's, and
    text outside any message, the content. Headers and markers are dropped.
    """

    def __init__(self, syntax: ReasoningSyntax):
        super().__init__(syntax)
        self.state = "body"  # "body" | "header" (after <|channel|>) | "role" (after <|start|>)
        self.channel = "final"  # text before any header is answer
        self.header = ""

    @property
    def in_reasoning(self) -> bool:
        return self.channel == "analysis" and self.state == "body"

    def _scan(self, reasoning, content):
        while self.buffer:
            at, marker = min(((self.buffer.find(m), m) for m in HARMONY_MARKERS
                              if self.buffer.find(m) >= 0), default=(-1, ""))
            settled = len(self.buffer) - _partial(self.buffer, HARMONY_MARKERS) if at < 0 else at
            self._text(self.buffer[:settled], reasoning, content)
            if at < 0:
                self.buffer = self.buffer[settled:]
                return
            self.buffer = self.buffer[at + len(marker):]
            self._marker(marker)

    def _text(self, text, reasoning, content):
        if self.state == "body" and text:
            (reasoning if self.channel == "analysis" else content).append(text)
        elif self.state == "header":
            self.header += text

    def _marker(self, marker):
        if marker == "<|channel|>":
            self.state, self.header = "header", ""
        elif marker == "<|message|>":
            # "analysis", "final", or "commentary to=functions.f <|constrain|>json"
            self.channel = (self.header.split() or ["final"])[0]
            self.state = "body"
        elif marker == "<|start|>":
            self.state = "role"
        else:  # <|end|>, <|return|>, <|call|>: the message is over; what follows is answer
            self.state, self.channel = "body", "final"

    def _flush(self, reasoning, content):
        self._text(self.buffer, reasoning, content)
        self.buffer = ""


def split(syntax: ReasoningSyntax | None, text: str, prompt_ids=()) -> tuple[str | None, str]:
    """A whole answer's (reasoning or None, content); the text unchanged for a model without reasoning."""
    if syntax is None:
        return None, text
    reasoning, content = syntax.splitter(prompt_ids).split(text)
    return reasoning or None, content
