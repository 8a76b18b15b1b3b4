"""A checkpoint directory's text side: its tokenizer (tokenizer.json, through the
optional `tokenizers` package), its chat template (tokenizer_config.json's
`chat_template` or a chat_template.jinja file, rendered by the optional `jinja2`
package in a sandbox) and its stop tokens (generation_config.json's, else
config.json's `eos_token_id`). The files are untrusted input: each value is
checked for its type before use (docs/checkpoints.md, "Text")."""

from __future__ import annotations

import json
import os

TEXT_EXTRA = "pip install 'jaxquant[text]'"  # what installs the optional packages below


def _json(path, name):
    """A JSON object file of the checkpoint, or None where it is absent."""
    file = os.path.join(path, name)
    if not os.path.exists(file):
        return None
    with open(file, encoding="utf-8") as f:
        try:
            value = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{file} must hold a JSON object; got {type(value).__name__}")
    return value


def _ids(value, where):
    """An eos_token_id value (an int or a list of ints) -> tuple of ids."""
    values = value if isinstance(value, list) else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{where}: eos_token_id must be a token id or a list of them "
                             f"(ints >= 0); got {value!r}")
    return tuple(values)


def stop_tokens(path) -> tuple[int, ...]:
    """The ids that end a generation: generation_config.json's eos_token_id (an int or
    a list), else config.json's; a .gguf file's tokenizer.ggml.eos_token_id. () where
    none is given."""
    if os.fspath(path).endswith(".gguf"):
        from jaxquant.models import gguf_checkpoint  # noqa: PLC0415 (reads the file on demand)
        eos = gguf_checkpoint.tokenizer(path).eos_id
        return () if eos is None else _ids(int(eos), os.fspath(path))
    for name in ("generation_config.json", "config.json"):
        cfg = _json(path, name)
        if cfg is not None and cfg.get("eos_token_id") is not None:
            return _ids(cfg["eos_token_id"], os.path.join(path, name))
    return ()


def tokenizer(path):
    """The checkpoint's tokenizers.Tokenizer (tokenizer.json). ValueError where the
    file is absent; ImportError naming the extra where the package is."""
    file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(file):
        raise ValueError(f"{path} has no tokenizer.json (text needs the checkpoint's tokenizer)")
    try:
        from tokenizers import Tokenizer  # noqa: PLC0415 (optional package)
    except ImportError:
        raise ImportError(f"reading {file} needs the `tokenizers` package: {TEXT_EXTRA}") from None
    return Tokenizer.from_file(file)


def _token_text(value):
    """tokenizer_config.json's bos_token / eos_token: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def chat_template(path) -> str | None:
    """The checkpoint's chat template (Jinja source), or None where it has none:
    tokenizer_config.json's chat_template (a string, or a list of {name, template}
    of which "default" is taken), else a chat_template.jinja file."""
    cfg = _json(path, "tokenizer_config.json") or {}
    template = cfg.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{path}: tokenizer_config.json's chat_template must be a string or a "
                         f"list of {{name, template}} with a 'default'; got {template!r:.80}")
    if template is None and os.path.exists(os.path.join(path, "chat_template.jinja")):
        with open(os.path.join(path, "chat_template.jinja"), encoding="utf-8") as f:
            template = f.read()
    return template


def render_chat(path, template: str, messages) -> str:
    """The prompt text of `messages` ([{"role", "content"}]) in the checkpoint's chat
    template, with the assistant's turn opened (add_generation_prompt). Rendered in
    jinja2's immutable sandbox (a template is the checkpoint's code: it may read
    only what it is given)."""
    try:
        from jinja2.exceptions import TemplateError  # noqa: PLC0415 (optional package)
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415
    except ImportError:
        raise ImportError("this checkpoint has a chat template; rendering it needs the `jinja2` "
                          f"package ({TEXT_EXTRA}), or pass --no-chat-template to use the "
                          "prompt as it is") from None
    cfg = _json(path, "tokenizer_config.json") or {}

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(
            messages=messages, add_generation_prompt=True,
            bos_token=_token_text(cfg.get("bos_token")),
            eos_token=_token_text(cfg.get("eos_token")))
    except TemplateError as e:
        raise ValueError(f"{path}: the chat template failed: {e}") from None
