"""Does a model directory's own chat template write conversations the way prepare-data does?

prepare-data writes Qwen2.5's template, or Qwen3's for a Qwen3 model (``template.py``). A model directory whose
``tokenizer_config.json`` (or ``chat_template.jinja``) carries another template expects another
format: :func:`check_model_template` renders probe conversations with that template, as
transformers' ``apply_chat_template`` does (a sandboxed jinja2 environment, ``tojson`` without HTML
escaping), and names the first difference.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from jobspec.data.formats import sharegpt_sample
from jobspec.data.template import QWEN3, chat_format, render

_WEATHER = {"name": "get_weather", "description": "Current weather of a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
# (ShareGPT/OpenAI record as prepare-data reads it, the same conversation as transformers' messages, tools)
PROBES = (
    ({"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
                   {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Green."}]},
     [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
      {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Green."}], None),
    ({"messages": [{"role": "user", "content": "Weather in Paris?"},
                   {"role": "assistant", "content": "", "tool_calls": [
                       {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                   {"role": "tool", "content": "18 C"}, {"role": "assistant", "content": "18 C in Paris."}],
      "tools": [_WEATHER]},
     [{"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "content": None, "tool_calls": [
          {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
      {"role": "tool", "content": "18 C"}, {"role": "assistant", "content": "18 C in Paris."}], [_WEATHER]),
)
_REASONED = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "reasoning_content": "Add.", "content": "4."},
             {"role": "user", "content": "And 3 + 3?"},
             {"role": "assistant", "reasoning_content": "Add.", "content": "6."}]
QWEN3_PROBES = (({"messages": _REASONED}, _REASONED, None),)  # reasoning: Qwen3's template writes it, Qwen2.5's not


def model_template(model_dir: str | Path) -> str | None:
    """The model directory's chat template (chat_template.jinja, else tokenizer_config.json's
    ``chat_template``; a list of named templates: the "default" one), or None."""
    d = Path(model_dir)
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text()
    try:
        t = json.loads((d / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, json.JSONDecodeError):
        return None
    if isinstance(t, list):
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    return t if isinstance(t, str) else None


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> Any:
    """``template`` compiled once as transformers compiles a chat template (sandboxed, loop controls)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: \
        json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def render_hf(template: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
              add_generation_prompt: bool = False, special_tokens: dict[str, str] | None = None) -> str:
    """The text transformers' ``apply_chat_template(messages, tools=tools, tokenize=False,
    add_generation_prompt=add_generation_prompt)`` gives (``special_tokens``: the tokenizer's ``bos_token``,
    ``eos_token``, which transformers passes to the template too)."""
    return str(_compiled(template).render(messages=messages, tools=tools,
                                          add_generation_prompt=add_generation_prompt, **(special_tokens or {})))


def check_model_template(model_dir: str | Path, system_prompt: str) -> tuple[str, str]:
    """("same" | "differs" | "none" | "unchecked", one line for the plan) for a model directory."""
    template = model_template(model_dir)
    fmt = chat_format(Path(model_dir) / "tokenizer.json")
    name = "Qwen3's" if fmt == QWEN3 else "Qwen2.5's"
    if template is None:
        return "none", f"{model_dir} has no chat template; the data is written in {name} format"
    for record, messages, tools in PROBES + (QWEN3_PROBES if fmt == QWEN3 else ()):
        ours = render(sharegpt_sample(record, "probe"), system_prompt, fmt)
        try:
            theirs = render_hf(template, [{"role": "system", "content": system_prompt}, *messages], tools)
        except Exception as e:  # a template may raise anything (raise_exception, undefined names)
            return "unchecked", f"the chat template of {model_dir} could not render a probe conversation ({e})"
        if theirs != ours:
            at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            what = ("a conversation with tool calls" if tools else "a conversation with reasoning"
                    if record["messages"] is _REASONED else "a multi-turn conversation")
            lo = max(0, at - 10)
            return "differs", (f"the chat template of {model_dir} writes {what} differently from prepare-data's "
                               f"{name} format, from character {at}: ours {ours[lo:at + 40]!r}, the model's "
                               f"{theirs[lo:at + 40]!r}; the model is trained in {name} format")
    return "same", f"the chat template of {model_dir} writes conversations as prepare-data does"
