"""A light tokenizer over `tokenizer.json`, without transformers (whose import pulls torch).

It offers what the engine's client side needs: encode, decode, incremental decode streams,
special-token ids and the chat template (rendered with jinja2 as transformers does).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream

from asyncengine.gguf.serving import tokenizer_folder


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return str(value.get("content")) if value.get("content") is not None else None
    return value if isinstance(value, str) else None


class Tokenizer:
    """Encode/decode for one model folder; `apply_chat_template` as in transformers."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = tokenizer_folder(model_dir)  # a GGUF file's: the folder built from it
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ValueError(
                f"{model_dir} has no tokenizer.json: asyncengine needs a fast (tokenizers) "
                "tokenizer saved with the model"
            )
        self._tok = _HFTokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_content(cfg.get("bos_token"))
        self.eos_token = _token_content(cfg.get("eos_token"))
        self.pad_token = _token_content(cfg.get("pad_token"))
        self.chat_template: str | None = None
        template_file = model_dir / "chat_template.jinja"
        if template_file.is_file():
            self.chat_template = template_file.read_text()
        elif isinstance(cfg.get("chat_template"), str):
            self.chat_template = cfg["chat_template"]
        self.add_bos_token = bool(cfg.get("add_bos_token", False))
        self.eos_token_id = self.token_to_id(self.eos_token)
        self.bos_token_id = self.token_to_id(self.bos_token)
        added = self._tok.get_added_tokens_decoder()
        self.all_special_ids = sorted(i for i, t in added.items() if t.special)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        # Some checkpoints ask for BOS in their config rather than in tokenizer.json.
        if (
            add_special_tokens
            and self.add_bos_token
            and self.bos_token_id is not None
            and (not ids or ids[0] != self.bos_token_id)
        ):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def decode_stream(self, prefix: Sequence[int], skip_special_tokens: bool) -> DecodeStream:
        """A stream whose step(token) returns the new text; `prefix` sets spacing context."""
        return DecodeStream(ids=list(prefix), skip_special_tokens=skip_special_tokens)

    def step(self, stream: DecodeStream, token_id: int) -> str | None:
        return stream.step(self._tok, token_id)  # type: ignore[no-any-return]

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **extra: Any,
    ) -> str | list[int]:
        """Render the model's chat template (jinja2, transformers' conventions)."""
        if self.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(
            x, ensure_ascii=False, indent=indent
        )
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        text = env.from_string(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            pad_token=self.pad_token or "",
            **extra,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text
