"""Tools in the order a session first sent them, so a tool added mid-session keeps the prefix.

Chat templates render the tool list near the top of the prompt (Qwen's, in the
system turn), so a tool inserted into the middle of the list changes every token
after it: the whole conversation is prefilled again. Claude Code does that when
its ToolSearch loads deferred tools (12 tools, then 21, in one session). Within
one session (a key the client sends: Anthropic's `metadata.user_id`, which Claude
Code fills with its session id, or OpenAI's `prompt_cache_key`), tools are
rendered in the order the session first sent them, so a new tool goes after the
known ones and the system prompt and the earlier tools stay a cached prefix.
Requests without a key render the tools as sent.
"""

from __future__ import annotations

from collections import OrderedDict

SESSIONS = 256  # sessions remembered, least recently used forgotten first


class ToolOrder:
    def __init__(self, sessions: int = SESSIONS):
        self.sessions = sessions
        self._seen: OrderedDict[str, dict[str, int]] = OrderedDict()

    def arrange(self, key: str | None, tools: list[dict] | None, name=lambda t: t["function"]["name"]):
        """`tools` in the session's first-seen order (new ones after, as sent); unchanged without a key."""
        if not key or not tools:
            return tools
        seen = self._seen.setdefault(key, {})
        self._seen.move_to_end(key)
        while len(self._seen) > self.sessions:
            self._seen.popitem(last=False)
        for tool in tools:
            seen.setdefault(name(tool), len(seen))
        return sorted(tools, key=lambda t: seen[name(t)])
