"""DeepSeek-V3.2's chat format as a Jinja chat template (flashdsa/assets/chat_template.jinja).

DeepSeek-V3.2 ships Python (the encoding/ folder of its release) instead of a template. This
template renders the same format: roles, tools, tool calls and results, and thinking mode
(``thinking=True`` opens a reasoning block). The tiny checkpoints and the default model carry it,
and a checkpoint without a template of its own (the official one) is rendered with it.
"""

from __future__ import annotations

from importlib import resources

THINK_START, THINK_END = "<think>", "</think>"  # around the reasoning of thinking mode
DSML = "｜DSML｜"  # the marker of the tool-call markup (a special token in DeepSeek-V3.2's tokenizer)
CHAT_TEMPLATE = (resources.files("flashdsa") / "assets" / "chat_template.jinja").read_text(encoding="utf-8")


def apply_chat_template(tokenizer, messages: list[dict], **kwargs) -> str:
    """messages rendered by the tokenizer's chat template, or by DeepSeek-V3.2's when it has none;
    kwargs (tools, add_generation_prompt, thinking, ...) go to the template."""
    template = None if getattr(tokenizer, "chat_template", None) else CHAT_TEMPLATE
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)
