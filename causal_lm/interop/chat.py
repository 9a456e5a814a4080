"""Chat templates: the checkpoint's own Jinja template, rendered the way `transformers` renders it.

An instruct model was trained on conversations laid out by one template (ChatML's `<|im_start|>user ...
<|im_end|>`, Llama 3's headers and `<|eot_id|>`, ...). The template ships with the checkpoint, in
`chat_template.jinja` or in `tokenizer_config.json` (a GGUF file has it as `tokenizer.chat_template`), and is
Jinja code that sees `messages`, `add_generation_prompt` and the named special tokens (`bos_token`,
`eos_token`, ...). It is rendered here in jinja2's sandbox with the settings and helpers transformers gives
templates (blocks trimmed, `loopcontrols`, a `tojson` that does not escape HTML, `raise_exception`,
`strftime_now`), so the text is the same, character for character (tests/test_chat_template.py).

The model ends its turn with a token the template writes after every assistant message (`<|im_end|>`,
`<|eot_id|>`, `<end_of_turn>`), which is often not EOS. `end_of_turn_id` finds it by rendering a two-message
conversation and reading the first special token after the assistant's text; the tokenizer keeps it among its
stop ids, so generation stops there.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any

CHAT_TEMPLATE_FILE = "chat_template.jinja"


class ChatTemplateError(ValueError):
    """No chat template, a template that does not render, or messages it cannot take."""


def _as_template(value, source: str) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of {name, template} (the "default" one)."""
    if value is None or isinstance(value, str):
        return value or None
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" in named:
            return named["default"]
        raise ChatTemplateError(f"{source}: several chat templates ({', '.join(map(str, named))}) and no 'default'")
    raise ChatTemplateError(f"{source}: chat_template is a {type(value).__name__}, expected a string")


def read_chat_template(folder: str, tokenizer_config: dict | None = None) -> str | None:
    """The chat template of a Hugging Face folder: chat_template.jinja, chat_template.json or tokenizer_config.json
    (in transformers' order: a separate file wins), or None."""
    jinja_path = os.path.join(folder, CHAT_TEMPLATE_FILE)
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read() or None
    json_path = os.path.join(folder, "chat_template.json")
    if os.path.isfile(json_path):
        with open(json_path, encoding="utf-8") as f:
            return _as_template(json.load(f).get("chat_template"), json_path)
    if tokenizer_config is not None:
        return _as_template(tokenizer_config.get("chat_template"), os.path.join(folder, "tokenizer_config.json"))
    return None


_ENV_CACHE: dict[str, Any] = {}


def _compile(template: str):
    """The template compiled in a sandboxed environment with transformers' settings and helpers (cached)."""
    if template in _ENV_CACHE:
        return _ENV_CACHE[template]
    try:
        import jinja2
        from jinja2 import nodes
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ChatTemplateError("chat templates need jinja2: pip install 'jinja2>=3.1.6'") from None

    class GenerationBlock(Extension):
        """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks): renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        compiled = env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template is not valid Jinja (line {e.lineno}): {e.message}") from None
    _ENV_CACHE[template] = compiled
    return compiled


def _check_messages(messages) -> list[dict]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, (list, tuple)):
        raise ChatTemplateError(
            f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got {type(messages).__name__}"
        )
    if not messages:
        raise ChatTemplateError("messages is empty: a chat needs at least one message")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ChatTemplateError(f"message {i} is {m!r}; expected a dict with 'role' and 'content'")
    return [dict(m) for m in messages]


def render_chat_template(
    template: str, messages, *, add_generation_prompt: bool = True, special_tokens: dict | None = None, **variables
) -> str:
    """`template` rendered for `messages` (the named special tokens and `variables` visible to it, as in
    transformers' apply_chat_template(..., tokenize=False))."""
    compiled = _compile(template)
    messages = _check_messages(messages)
    context = {**(special_tokens or {}), **variables}
    try:
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **context)
    except ChatTemplateError:
        raise
    except Exception as e:  # the template's own raise_exception ("roles must alternate") and render-time errors
        raise ChatTemplateError(f"the chat template refused these messages: {type(e).__name__}: {e}") from None


def apply_chat_template(tokenizer, messages, add_generation_prompt: bool = True, *, tokenize: bool = False, **kwargs):
    """Render `messages` with the tokenizer's chat template (the checkpoint's own).

    messages: [{"role": "system" | "user" | "assistant", "content": str}, ...]. add_generation_prompt: end with
    the header that opens the assistant's turn, so the model writes the reply. Extra keyword arguments are
    template variables (e.g. `enable_thinking=False`). Returns the text, or with tokenize=True its ids (encoded
    as written: the template places BOS itself). A tokenizer without a template is a ChatTemplateError.
    """
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        kind = getattr(tokenizer, "kind", type(tokenizer).__name__)
        raise ChatTemplateError(
            f"this tokenizer ({kind}) has no chat template: the checkpoint ships none (chat_template.jinja, "
            "tokenizer_config.json's chat_template, or a GGUF file's tokenizer.chat_template); prompt it with "
            "plain text instead"
        )
    text = render_chat_template(
        template,
        messages,
        add_generation_prompt=add_generation_prompt,
        special_tokens=getattr(tokenizer, "special_tokens", None),
        **kwargs,
    )
    return tokenizer.encode(text) if tokenize else text


_PROBE_USER, _PROBE_REPLY = "Hi there.", "Hello. How can I help?"


def end_of_turn_id(tok, template: str, special_tokens: dict | None = None) -> int | None:
    """The id of the special token `template` writes right after an assistant message, or None.

    tok: a `tokenizers.Tokenizer`. Renders user + assistant messages and encodes what follows the reply: its first
    token, when that is one of the tokenizer's special tokens (`<|im_end|>`, `<|eot_id|>`, `</s>`, ...).
    """
    messages = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_REPLY}]
    try:
        text = render_chat_template(template, messages, add_generation_prompt=False, special_tokens=special_tokens)
    except ChatTemplateError:
        return None
    at = text.rfind(_PROBE_REPLY)
    if at < 0:
        return None
    rest = text[at + len(_PROBE_REPLY) :].lstrip(" ")
    ids = tok.encode(rest, add_special_tokens=False).ids if rest else []
    specials = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    return ids[0] if ids and ids[0] in specials else None
