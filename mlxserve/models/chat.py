"""A conversation rendered with the model's own chat template.

Below api/ (requests), multimodal/ (prompts with images), the offline `LLM` and the
benchmarks, which all render chats the same way.
"""

from __future__ import annotations


def render_chat(tokenizer, messages: list[dict], *, tools=None, chat_template_kwargs=None,
                add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a conversation rendered with the model's own chat template."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model has no chat template; use a plain completion prompt")
    kwargs = dict(chat_template_kwargs or {})
    ids = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
