"""Tokenizer: text <-> token ids, chat templates, and streaming detokenization.

`Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust fast tokenizer) built either
from an HF checkpoint directory (`tokenizer.json` + configs) or from the
metadata of a GGUF file (vocabulary, merges, token types, chat template).

`IncrementalDetokenizer` turns a stream of generated ids into text deltas that
never split a UTF-8 character and add up to exactly `Tokenizer.decode(ids)`.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any, Iterable

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

# llama.cpp's `tokenizer.ggml.token_type` values we act on.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Text-splitting regexes of well-known byte-level BPE vocabularies, keyed by
# llama.cpp's `tokenizer.ggml.pre` name.  BPE merges were learned on text split
# this way, so the split must match for ids to match the original tokenizer.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Same as Llama 3 but numbers are split into single digits.
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


class Tokenizer:
    """Encode/decode text and render chat prompts for one model."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
        add_bos_token: bool = False,
        unk_token_id: int | None = None,
        pad_token_id: int | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self.unk_token_id = unk_token_id
        self.pad_token_id = pad_token_id
        self.eos_token_ids: set[int] = {i for i in (eos_token_id, *extra_eos_token_ids) if i is not None}
        self.all_special_ids: set[int] = _special_ids(backend) | {
            i for i in (bos_token_id, eos_token_id, unk_token_id, pad_token_id) if i is not None
        }
        self._compiled_template: jinja2.Template | None = None

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def from_gguf_reader(cls, reader: Any) -> Tokenizer:
        """Build from an already open file: `GGUFCheckpoint.reader` (a `loader.gguf_file.GGUFFile`) or a
        `gguf.GGUFReader`, saving the parse of the file's metadata."""
        return _tokenizer_from_gguf_reader(reader)

    @classmethod
    def from_pretrained(cls, path: str) -> Tokenizer:
        """Load from an HF checkpoint directory or a `.gguf` file."""
        path = os.path.expanduser(path)
        if os.path.isdir(path):
            return _tokenizer_from_hf_dir(path)
        if os.path.isfile(path) and path.endswith(".gguf"):
            return _tokenizer_from_gguf(path)
        raise FileNotFoundError(f"{path!r} is neither a checkpoint directory nor a .gguf file")

    # --- ids <-> text ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self.id_to_token(self.eos_token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, BOS is prepended if the model wants it."""
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        # GGUF models (and some HF configs) state "add BOS" as a flag rather than
        # through a post-processor; a post-processor may already have added it.
        wants_bos = add_special_tokens and self.add_bos_token and self.bos_token_id is not None
        if wants_bos and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str | None]:
        return [self.backend.id_to_token(i) for i in ids]

    # --- chat -----------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render `messages` (dicts with `role`/`content`) into the model's prompt text."""
        if self.chat_template is None:
            raise ValueError(
                "This model has no chat template; pass a plain prompt instead of chat messages."
            )
        variables = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "unk_token": self.id_to_token(self.unk_token_id) or "",
            "pad_token": self.id_to_token(self.pad_token_id) or "",
            **kwargs,
            "messages": messages,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template().render(**variables)
        except jinja2.TemplateError as error:
            raise ValueError(f"chat template failed: {error}") from error

    def _template(self) -> jinja2.Template:
        if self._compiled_template is None:
            self._compiled_template = _compile_chat_template(self.chat_template)
        return self._compiled_template


def _special_ids(backend: BackendTokenizer) -> set[int]:
    return {i for i, token in backend.get_added_tokens_decoder().items() if token.special}


# --- chat template rendering --------------------------------------------------------------------


class _GenerationBlock(jinja2.ext.Extension):
    """Accept `{% generation %}...{% endgeneration %}` and render its body unchanged.

    Some templates mark assistant text this way (HF uses it to build masks);
    without the tag the template would not even parse.
    """

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _compile_chat_template(source: str) -> jinja2.Template:
    # Same environment options as HF transformers, so templates render identically;
    # the sandbox keeps a checkpoint's template from touching Python internals.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # jinja's built-in tojson HTML-escapes `<>&'`, which would corrupt prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_template_error(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


# --- HF checkpoint directories ------------------------------------------------------------------


def _tokenizer_from_hf_dir(path: str) -> Tokenizer:
    tokenizer_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tokenizer_file):
        raise FileNotFoundError(f"{path} has no tokenizer.json")
    backend = BackendTokenizer.from_file(tokenizer_file)
    config = _read_json(os.path.join(path, "tokenizer_config.json"))
    _add_configured_tokens(backend, config.get("added_tokens_decoder") or {})
    model_config = _read_json(os.path.join(path, "config.json"))
    generation_config = _read_json(os.path.join(path, "generation_config.json"))

    bos_id = _configured_token_id(backend, config.get("bos_token"), model_config.get("bos_token_id"))
    eos_id = _configured_token_id(backend, config.get("eos_token"), model_config.get("eos_token_id"))
    return Tokenizer(
        backend,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        extra_eos_token_ids=_as_id_list(generation_config.get("eos_token_id")),
        chat_template=_hf_chat_template(path, config),
        add_bos_token=bool(config.get("add_bos_token", False)),
        unk_token_id=_configured_token_id(backend, config.get("unk_token"), None),
        pad_token_id=_configured_token_id(backend, config.get("pad_token"), None),
    )


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _add_configured_tokens(backend: BackendTokenizer, added_tokens: dict) -> None:
    """Add tokens listed in tokenizer_config.json that tokenizer.json lacks."""
    for entry in added_tokens.values():
        content = entry["content"]
        if backend.token_to_id(content) is not None:
            continue
        token = AddedToken(
            content,
            single_word=entry.get("single_word", False),
            lstrip=entry.get("lstrip", False),
            rstrip=entry.get("rstrip", False),
            normalized=entry.get("normalized", not entry.get("special", False)),
            special=entry.get("special", False),
        )
        if token.special:
            backend.add_special_tokens([token])
        else:
            backend.add_tokens([token])


def _configured_token_id(backend: BackendTokenizer, token: Any, fallback_id: Any) -> int | None:
    """Id of a special token given as a string or `{"content": ...}` dict in a config."""
    if isinstance(token, dict):
        token = token.get("content")
    if isinstance(token, str):
        token_id = backend.token_to_id(token)
        if token_id is not None:
            return token_id
    ids = _as_id_list(fallback_id)
    return ids[0] if ids else None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _hf_chat_template(path: str, config: dict) -> str | None:
    """The default chat template, from `chat_template.jinja`/`.json` or tokenizer_config.json."""
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    template = _read_json(os.path.join(path, "chat_template.json")).get("chat_template")
    if template is None:
        template = config.get("chat_template")
    # Some models ship several named templates; "default" is the one for chat.
    if isinstance(template, list):
        named = {entry["name"]: entry["template"] for entry in template}
        template = named.get("default", next(iter(named.values()), None))
    return template


# --- GGUF files ---------------------------------------------------------------------------------


def _tokenizer_from_gguf(path: str) -> Tokenizer:
    from deepserve.loader.gguf_loader import open_reader

    return _tokenizer_from_gguf_reader(open_reader(path))


def _tokenizer_from_gguf_reader(reader: Any) -> Tokenizer:
    from deepserve.loader.gguf_loader import read_field

    def meta(key: str, default: Any = None) -> Any:
        return read_field(reader, f"tokenizer.{key}", default)

    model = meta("ggml.model")
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2')")
    tokens = meta("ggml.tokens")
    token_types = meta("ggml.token_type") or [1] * len(tokens)
    backend = _byte_level_bpe(tokens, token_types, meta("ggml.merges", []))
    backend.pre_tokenizer = _gguf_pre_tokenizer(meta("ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    _add_gguf_added_tokens(backend, tokens, token_types)
    return Tokenizer(
        backend,
        bos_token_id=meta("ggml.bos_token_id"),
        eos_token_id=meta("ggml.eos_token_id"),
        extra_eos_token_ids=[i for i in (meta("ggml.eot_token_id"), meta("ggml.eom_token_id")) if i is not None],
        chat_template=meta("chat_template"),
        add_bos_token=bool(meta("ggml.add_bos_token", False)),
        unk_token_id=meta("ggml.unknown_token_id"),
        pad_token_id=meta("ggml.padding_token_id"),
    )


def _byte_level_bpe(tokens: list[str], token_types: list[int], merges: list[str]) -> BackendTokenizer:
    byte_to_char = _byte_to_char()
    alphabet = set(byte_to_char.values())
    vocab = {}
    for token_id, (token, token_type) in enumerate(zip(tokens, token_types, strict=True)):
        # Control tokens are matched as whole strings before BPE, so they keep
        # their literal text.  A normal token is stored in the byte alphabet; a
        # converter that wrote it as raw text gets it re-spelled here.
        if token_type != _TOKEN_TYPE_CONTROL and not set(token) <= alphabet:
            token = "".join(byte_to_char[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, token_id)
    merge_pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    return BackendTokenizer(models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=False, byte_fallback=False))


def _gguf_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # SmolLM's tokenizer.json: every digit is its own piece, then GPT-2 splitting.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    split = _PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        # Unknown scheme: GPT-2's regex is the common ancestor of most of them.
        return byte_level
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _add_gguf_added_tokens(backend: BackendTokenizer, tokens: list[str], token_types: list[int]) -> None:
    """Make control tokens special (whole-string match, skippable on decode) and
    user-defined ones plain added tokens (whole-string match, always decoded)."""
    control = [t for t, kind in zip(tokens, token_types, strict=True) if kind == _TOKEN_TYPE_CONTROL]
    user_defined = [t for t, kind in zip(tokens, token_types, strict=True) if kind == _TOKEN_TYPE_USER_DEFINED]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    vocab = backend.get_vocab(with_added_tokens=False)
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined if t in vocab])


def _byte_to_char() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE.

    Bytes that are already visible Latin-1 characters map to themselves; the
    rest (controls, space, ...) are moved to code points 256 and up, in order.
    """
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in visible}
    hidden = [b for b in range(256) if b not in mapping]
    mapping.update({b: chr(256 + n) for n, b in enumerate(hidden)})
    return mapping


# --- streaming detokenization -------------------------------------------------------------------


class IncrementalDetokenizer:
    """Turn generated ids into text deltas, one step at a time.

    Each step decodes only a short window: the ids whose text was emitted by
    the previous step (`prefix`) plus the ids not yet emitted.  The delta is
    the window's text minus the prefix's text.  Decoding the prefix along with
    the new ids (rather than the new ids alone) keeps decoders that depend on
    context (e.g. sentencepiece stripping a leading space) consistent.

    Text ending in U+FFFD is held back: it means the last bytes are an
    incomplete UTF-8 character that a later token completes.  Because windows
    start only where earlier text ended on a whole character, the deltas add
    up to `tokenizer.decode(all_ids)`; call `flush()` at the end to get any
    text still held (an unfinished character when generation stopped).
    """

    # Prompt tokens decoded ahead of the first generated token, for context.
    PROMPT_CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Iterable[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids or [])[-self.PROMPT_CONTEXT_TOKENS:]
        # Only the window is kept: ids before `_prefix` are never decoded again.
        self._ids: list[int] = context
        self._prefix = 0
        self._read = len(context)

    def step(self, new_ids: Iterable[int]) -> str:
        """Add generated ids; return the text they complete (may be empty)."""
        self._ids.extend(new_ids)
        return self._emit(hold_incomplete=True)

    def flush(self) -> str:
        """Return all text not yet emitted, even an incomplete trailing character."""
        return self._emit(hold_incomplete=False)

    def _emit(self, hold_incomplete: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        window_text = self._decode(self._ids[self._prefix:])
        if len(window_text) <= len(prefix_text):
            return ""
        if hold_incomplete and window_text.endswith("\ufffd"):
            return ""
        # The ids just emitted become the next window's prefix.
        del self._ids[:self._read]
        self._prefix, self._read = 0, len(self._ids)
        return window_text[len(prefix_text):]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""
