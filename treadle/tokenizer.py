"""The model's tokenizer: a ``tokenizers.Tokenizer`` plus the special tokens, the
BOS/EOS rule and the chat template the checkpoint declares.

BOS/EOS: in a Hugging Face directory, tokenizer.json's post-processor decides, as in
transformers 5 (which ignores tokenizer_config's ``add_bos_token`` when it is there).
When tokenizer.json has none, ``add_bos_token`` / ``add_eos_token`` from
tokenizer_config.json build one (transformers 5 would add nothing; 4.x honoured the
flags). GGUF files state the flags in their metadata, which always applies.
"""
from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, overload

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import processors

from treadle.config import TreadleError

_GIL_FREE_FROM_CHARS = 4096


def _raise_from_template(message: str) -> None:
    raise TreadleError(f"chat template: {message}")


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_from_template
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _flatten_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """Content given as a list of {"type": "text", "text": ...} parts becomes one string."""
    content = message.get("content")
    if not isinstance(content, list):
        return dict(message)
    texts = []
    for part in content:
        if not isinstance(part, Mapping) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise TreadleError(f"message content part of type {kind!r} is not supported (only 'text')")
        texts.append(str(part.get("text", "")))
    return {**message, "content": "".join(texts)}


class Tokenizer:
    def __init__(
        self,
        backend: BackendTokenizer,
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
        extra_eos_token_ids: Iterable[int] = (),
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id: int | None = self._id_of(bos_token)
        eos_id = self._id_of(eos_token)
        own_eos = () if eos_id is None else (eos_id,)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys((*own_eos, *extra_eos_token_ids)))
        self.chat_template = chat_template
        self._template: jinja2.Template | None = None
        if add_bos_token is not None or add_eos_token is not None:
            self._set_post_processor(bool(add_bos_token), bool(add_eos_token))
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        added = backend.get_added_tokens_decoder()
        self.all_special_ids: set[int] = {i for i, t in added.items() if t.special}
        self.all_special_ids.update(i for i in (self.bos_token_id, *self.eos_token_ids) if i is not None)
        self._token_texts: dict[int, str] = {}  # token_text's cache

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def _set_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        bos = (self.bos_token, self.bos_token_id) if add_bos and self.bos_token_id is not None else None
        eos = (self.eos_token, self._id_of(self.eos_token)) if add_eos and self.eos_token is not None else None
        special = [t for t in (bos, eos) if t is not None]

        def template(seq: str, type_id: int) -> list[str]:
            before = [f"{bos[0]}:{type_id}"] if bos else []
            after = [f"{eos[0]}:{type_id}"] if eos else []
            return [*before, f"${seq}:{type_id}", *after]

        single = " ".join(template("A", 0))
        pair = " ".join(template("A", 0) + template("B", 1))
        self.backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)

    # -- text <-> ids ------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Long texts go through ``encode_batch``, which releases the
        GIL while it works, so encoding in a worker thread does not stall the other threads."""
        if len(text) < _GIL_FREE_FROM_CHARS:
            return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)
        return list(self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest vocabulary entry in characters: a text of ``c`` characters has at
        least ``c / max_token_chars`` tokens (a cheap length bound before encoding)."""
        return max((len(t) for t in self.backend.get_vocab(with_added_tokens=True)), default=1) or 1

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text as it reads after other text (logprob entries): decoded after an
        anchor token and cut off it, because decoding a lone token drops the leading space
        SentencePiece vocabularies mark ("▁there" -> "there" alone, " there" after "a")."""
        text = self._token_texts.get(token_id)
        if text is None:
            anchor = self._anchor
            if anchor is None:
                text = self.decode([token_id], skip_special_tokens=False)
            else:
                base = self.decode([anchor], skip_special_tokens=False)
                both = self.decode([anchor, token_id], skip_special_tokens=False)
                text = both[len(base):] if both.startswith(base) else self.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text

    @functools.cached_property
    def _anchor(self) -> int | None:
        ids = self.encode("a", add_special_tokens=False)
        return ids[-1] if ids else None

    @overload
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, *, tokenize: Literal[False] = False) -> str: ...

    @overload
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, *, tokenize: Literal[True]) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, *, tokenize: bool = False) -> str | list[int]:
        """``tools``: OpenAI tool definitions, handed to the template as ``tools`` (templates
        that know tools format them into the prompt; None when the request has none).
        ``tokenize``: the prompt's token ids instead of its text (as transformers' tokenizers)."""
        text = self._render_chat(messages, add_generation_prompt, tools)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    # -- what transformers' tokenizers also offer (for code written against them) ------------
    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def __len__(self) -> int:
        return self.vocab_size

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self.backend.id_to_token(int(i)) for i in ids]

    def _render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                     tools: list[dict[str, Any]] | None) -> str:
        if self.chat_template is None:
            raise TreadleError("this model has no chat template; send plain prompts instead")
        if self._template is None:
            try:
                self._template = _compile_template(self.chat_template)
            except jinja2.TemplateError as e:
                raise TreadleError(f"chat template does not compile: {e}") from None
        try:
            return self._template.render(
                messages=[_flatten_message(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as e:
            raise TreadleError(f"chat template failed: {e}") from None

    # -- to another process ------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """This tokenizer as plain data (``from_dict`` rebuilds it): the backend's own JSON,
        whose post-processor already holds the BOS/EOS rule, and what is kept beside it. The
        engine process sends it to the API process, which then need not open the checkpoint."""
        return {"backend": self.backend.to_str(), "bos_token": self.bos_token, "eos_token": self.eos_token,
                "eos_token_ids": list(self.eos_token_ids), "chat_template": self.chat_template}

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> Tokenizer:
        """The tokenizer ``to_dict`` described (a malformed ``data`` is a TreadleError)."""
        try:
            backend = BackendTokenizer.from_str(data["backend"])
            return Tokenizer(backend, data["bos_token"], data["eos_token"], data["chat_template"],
                             extra_eos_token_ids=data["eos_token_ids"])
        except Exception as e:  # the library raises bare Exceptions on malformed JSON
            raise TreadleError(f"not a serialized tokenizer ({e!r})") from None

    # -- constructors --------------------------------------------------------------------
    @staticmethod
    def from_hf_dir(path: str | Path, extra_eos_token_ids: Iterable[int] = ()) -> Tokenizer:
        """tokenizer.json + tokenizer_config.json (+ chat_template.jinja, special_tokens_map.json)."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        cfg = read_json_object(path / "tokenizer_config.json")
        specials = read_json_object(path / "special_tokens_map.json")
        if tok_file.is_file():
            try:
                backend = BackendTokenizer.from_file(str(tok_file))
            except Exception as e:  # the library raises bare Exceptions on malformed files
                raise TreadleError(f"{tok_file}: not a valid tokenizer.json ({e})") from None
            default_add_bos = False
        elif (path / "tokenizer.model").is_file():
            backend = _sentencepiece_backend(path / "tokenizer.model")
            default_add_bos = True  # LlamaTokenizer's default, as Llama-2 and Mistral rely on
        else:
            raise TreadleError(f"{path}: no tokenizer (neither tokenizer.json nor tokenizer.model); add one, "
                               "or pass skip_tokenizer_init=True (--skip-tokenizer-init) to work in token ids")
        template_file = path / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else _pick_template(cfg.get("chat_template"))
        has_post = backend.post_processor is not None
        vocab = backend.get_vocab(with_added_tokens=True)
        return Tokenizer(
            backend,
            bos_token=_token_text(cfg.get("bos_token", specials.get("bos_token", "<s>" if "<s>" in vocab else None))),
            eos_token=_token_text(cfg.get("eos_token", specials.get("eos_token", "</s>" if "</s>" in vocab else None))),
            chat_template=template,
            add_bos_token=None if has_post else bool(cfg.get("add_bos_token", default_add_bos)),
            add_eos_token=None if has_post else bool(cfg.get("add_eos_token", False)),
            extra_eos_token_ids=extra_eos_token_ids,
        )

    @staticmethod
    def from_gguf_metadata(metadata: Mapping[str, Any], extra_eos_token_ids: Iterable[int] = ()) -> Tokenizer:
        """From decoded GGUF key/values (``tokenizer.ggml.*``, ``tokenizer.chat_template``)."""
        from treadle.vocab import byte_level_bpe, sentencepiece_bpe

        kind = metadata.get("tokenizer.ggml.model")
        pieces: list[str] = list(metadata.get("tokenizer.ggml.tokens", []))
        if not pieces:
            raise TreadleError("GGUF metadata has no tokenizer.ggml.tokens: give token ids with "
                               "skip_tokenizer_init=True (--skip-tokenizer-init), or use a file with a tokenizer")
        types = list(metadata.get("tokenizer.ggml.token_type", [1] * len(pieces)))
        if kind == "gpt2":
            backend = byte_level_bpe(
                pieces, metadata.get("tokenizer.ggml.merges", []), types, metadata.get("tokenizer.ggml.pre")
            )
            default_add_bos = False
        elif kind == "llama":
            scores = list(metadata.get("tokenizer.ggml.scores", [0.0] * len(pieces)))
            backend = sentencepiece_bpe(
                pieces, scores, types, metadata.get("tokenizer.ggml.unknown_token_id"),
                bool(metadata.get("tokenizer.ggml.add_space_prefix", True)),
            )
            default_add_bos = True  # llama.cpp adds BOS to SentencePiece vocabularies unless told not to
        else:
            raise TreadleError(f"tokenizer model {kind!r} is not supported (supported: gpt2, llama)")

        def piece(key: str) -> str | None:
            idx = metadata.get(f"tokenizer.ggml.{key}")
            return pieces[idx] if idx is not None and 0 <= idx < len(pieces) else None

        return Tokenizer(
            backend,
            bos_token=piece("bos_token_id"),
            eos_token=piece("eos_token_id"),
            chat_template=metadata.get("tokenizer.chat_template"),
            add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", default_add_bos)),
            add_eos_token=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
            extra_eos_token_ids=extra_eos_token_ids,
        )


def _sentencepiece_backend(path: Path) -> BackendTokenizer:
    """A SentencePiece BPE ``tokenizer.model`` as a ``tokenizers`` tokenizer."""
    from treadle.sentencepiece_model import read_sentencepiece_model
    from treadle.vocab import sentencepiece_bpe

    sp = read_sentencepiece_model(path)
    return sentencepiece_bpe(sp.pieces, sp.scores, sp.types, sp.unk_id, sp.add_dummy_prefix)


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file holding an object ({} when the file is absent); bad JSON is a TreadleError."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TreadleError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise TreadleError(f"{path}: expected a JSON object")
    return data


def _token_text(token: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _pick_template(template: Any) -> str | None:
    """tokenizer_config's chat_template: a string, or a list of named templates."""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None
