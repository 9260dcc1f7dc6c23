"""`Tokenizer`: a local `tokenizer.json` (Hugging Face `tokenizers`) plus `tokenizer_config.json`.

What it owns: encode/decode with the special-token behaviour transformers gives the same files,
and the chat template. Files read from the directory (never the network): `tokenizer.json`
(required), `tokenizer_config.json`, `special_tokens_map.json`, `chat_template.jinja`
(transformers 5 writes the template there; it wins over `chat_template` in the config).

Special tokens are added as transformers 5.x adds them when a `tokenizer.json` is present (its
`_from_pretrained` drops `add_bos_token` / `add_eos_token` from tokenizer_config.json, whatever the
`tokenizer_class`): the post-processor of `tokenizer.json` is used as is; without one, nothing is
added (transformers installs an empty template, `$A` / `$A $B`). The flags themselves are ignored.

Chat prompts: `chat_prompt_ids` is `apply_chat_template(messages, tokenize=True,
add_generation_prompt=True)`: the rendered text encoded *without* adding special tokens, as
transformers encodes it; a template that writes the BOS itself gets exactly one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

from contbatch.engine.chat_template import render_chat
from contbatch.engine.errors import CheckpointError

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value: object) -> str | None:
    """A special token as written in the config: a string, or an AddedToken object with `content`."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_optional_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class Tokenizer:
    """Encode, decode and chat-template one local tokenizer; see the module docstring."""

    def __init__(self, backend: HFTokenizer, config: Mapping[str, Any], chat_template: str | None = None) -> None:
        self.backend = backend
        self._encode_many = getattr(backend, "encode_batch_fast", backend.encode_batch)  # (see `encode`)
        self.config = dict(config)
        self.chat_template = chat_template
        self.special_tokens: dict[str, str] = {}
        for name in SPECIAL_TOKEN_NAMES:
            text = _token_text(config.get(name))
            if text is not None:
                self.special_tokens[name] = text
        self.bos_token_id = self._id_of(self.special_tokens.get("bos_token"))
        self.eos_token_id = self._id_of(self.special_tokens.get("eos_token"))
        if backend.post_processor is None:  # transformers' update_post_processor with both flags off
            backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        directory = Path(path).expanduser()
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise CheckpointError(f"{directory}: no tokenizer.json (only fast tokenizer files are supported)")
        try:
            backend = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:
            raise CheckpointError(f"{tokenizer_file}: not a readable tokenizer ({exc})") from None
        config = _read_optional_json(directory / "special_tokens_map.json")
        config.update(_read_optional_json(directory / "tokenizer_config.json"))
        return cls(backend, config, _chat_template(directory, config))

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Ids in [0, vocab_size) decode (added tokens included)."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """`text`'s token ids, as the backend's `encode` gives them. Through its batch call
        (`encode_batch_fast`, no character offsets; `encode_batch` before tokenizers 0.21), which
        releases Python's GIL while it runs: a server's event loop and step driver go on meanwhile
        (the single `encode` holds the GIL for about 1 µs a token)."""
        return list(self._encode_many([text], add_special_tokens=add_special_tokens)[0].ids)

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """The rendered prompt (or its ids, encoded without adding special tokens, as transformers does)."""
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat template (tokenizer_config.json / chat_template.jinja)")
        text = render_chat(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens,
            **kwargs,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def chat_prompt_ids(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> list[int]:
        """The token ids of the chat prompt for `messages`, as transformers'
        `apply_chat_template(messages, tokenize=True, add_generation_prompt=True)` gives them."""
        ids = self.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
        assert isinstance(ids, list)
        return ids
