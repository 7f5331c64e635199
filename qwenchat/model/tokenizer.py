"""The model's own tokenizer.json and chat template, and a streaming detokenizer."""

from __future__ import annotations

import bisect
import json
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qwenchat.errors import ModelError, UsageError

THINK_START = "<think>"
THINK_END = "</think>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"


def check_text(text: str, what: str) -> None:
    """Refuse text that holds bytes which were not UTF-8: the OS hands such bytes of an argument
    or a pipe to Python as lone surrogates, which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UsageError(f"{what} is not valid UTF-8 text (an undecodable byte at character "
                         f"{exc.start:,}); convert it to UTF-8 first") from None


@dataclass(frozen=True)
class Message:
    role: str  # "system" | "user" | "assistant"
    content: str

    def as_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


class ChatTemplate:
    """A Hugging Face chat template rendered the way transformers renders it.

    Same Jinja settings as `apply_chat_template` (sandboxed, trim_blocks, lstrip_blocks,
    loop controls, a `tojson` that keeps non-ASCII text and `raise_exception`), so the
    rendered prompt is byte-for-byte the one the model was trained with.
    """

    def __init__(self, source: str, special_tokens: dict[str, str | None]):
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_template_error
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise ModelError(f"chat template does not compile: {exc}") from None
        self._special_tokens = special_tokens

    def render(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
    ) -> str:
        from jinja2 import TemplateError

        try:
            return self._template.render(
                messages=[m.as_dict() for m in messages],
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                enable_thinking=enable_thinking,
                **self._special_tokens,
            )
        except TemplateError as exc:
            raise ModelError(f"chat template failed to render: {exc}") from None


class Tokenizer:
    """tokenizers.Tokenizer plus the chat template and the special ids qwenchat acts on."""

    def __init__(self, directory: Path):
        from tokenizers import Tokenizer as HFTokenizer

        path = directory / "tokenizer.json"
        if not path.is_file():
            raise ModelError(f"{path} not found: qwenchat needs the model's tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises plain Exception for bad files
            raise ModelError(f"{path}: not a valid tokenizer.json ({exc})") from None
        config = _read_tokenizer_config(directory)
        self.template = ChatTemplate(_chat_template_source(directory, config),
                                     _special_token_strings(config))
        self.think_start_id = self._tok.token_to_id(THINK_START)
        self.think_end_id = self._tok.token_to_id(THINK_END)
        self.im_start_id = self._tok.token_to_id(IM_START)
        self.im_end_id = self._tok.token_to_id(IM_END)
        self.end_of_text_id = self._tok.token_to_id(END_OF_TEXT)
        self._cut_ids: frozenset[int] | None = None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def same_vocabulary(self, other: Tokenizer) -> bool:
        """Whether both map every token to the same id (a draft model's must be the target's)."""
        return (self.vocab_size == other.vocab_size
                and self._tok.get_vocab(with_added_tokens=True)
                == other._tok.get_vocab(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def render(self, messages: Sequence[Message], enable_thinking: bool,
               add_generation_prompt: bool = True) -> str:
        return self.template.render(messages, add_generation_prompt, enable_thinking)

    def encode_chat(self, messages: Sequence[Message], enable_thinking: bool) -> list[int]:
        return self.encode(self.render(messages, enable_thinking))

    def encode_with_cuts(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of `text`, and after which characters (and tokens) the text can be cut so
        that both sides encode on their own to the same ids: just after a special token that
        the tokenizer matches before normalising and that absorbs no whitespace (the text is
        split at those before anything else happens to it)."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        cut_after = self._cut_after_ids
        cuts = [(end, i + 1) for i, ((_, end), token) in enumerate(zip(encoding.offsets,
                                                                        encoding.ids,
                                                                        strict=True))
                if token in cut_after]
        return list(encoding.ids), cuts

    @property
    def _cut_after_ids(self) -> frozenset[int]:
        if self._cut_ids is None:
            self._cut_ids = frozenset(
                token_id for token_id, added in self._tok.get_added_tokens_decoder().items()
                if added.special and not added.normalized and not added.lstrip
                and not added.rstrip)
        return self._cut_ids

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)


class PrefixReuse:
    """Encodes texts that mostly repeat earlier ones, as a conversation's renderings do (each
    turn renders the whole conversation again): the ids of the longest earlier prefix that ends
    at a cut (Tokenizer.encode_with_cuts) are reused and only the rest is encoded, so a long
    chat's later turns do not re-tokenize all of it. The result is exactly `encode(text)`."""

    def __init__(self, tokenizer: Tokenizer, keep: int = 4):
        self._tokenizer = tokenizer
        self._recent: deque[tuple[str, list[int], list[tuple[int, int]]]] = deque(maxlen=keep)

    def encode(self, text: str) -> list[int]:
        chars, tokens, source = 0, 0, None
        for old_text, old_ids, old_cuts in self._recent:
            shared = shared_prefix_length(text, old_text)
            i = bisect.bisect_right(old_cuts, (shared, len(old_ids) + 1)) - 1
            if i >= 0 and old_cuts[i][0] > chars:
                (chars, tokens), source = old_cuts[i], (old_ids, old_cuts[: i + 1])
        rest_ids, rest_cuts = self._tokenizer.encode_with_cuts(text[chars:])
        ids, cuts = rest_ids, [(c + chars, t + tokens) for c, t in rest_cuts]
        if source is not None:
            ids = source[0][:tokens] + ids
            cuts = source[1] + cuts
        self._recent.append((text, ids, cuts))
        return list(ids)

    def remember(self, text: str, ids: list[int], cuts: list[tuple[int, int]]) -> None:
        """Take `text`'s encoding (Tokenizer.encode_with_cuts) as if encode had made it: a
        later encode of the same text encodes only what follows its last cut."""
        self._recent.append((text, list(ids), list(cuts)))


def shared_prefix_length(a: Sequence, b: Sequence) -> int:
    """How many leading items two sequences of one type (texts, id lists) share: a binary
    search on C-speed slice compares, not a Python loop over a whole conversation."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class StreamDecoder:
    """Turns token ids into text pieces as they arrive, never splitting a UTF-8 character.

    Each piece is the difference between decoding a short window of recent ids with and
    without the newest ones; text is held back while it ends in an incomplete character
    (U+FFFD). `finish()` returns whatever the window still holds, so the pieces always
    concatenate to exactly `tokenizer.decode(all ids)`.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the window that gives context for the next piece
        self._read = 0  # ids up to here have been turned into text
        self._emitted: list[str] = []

    @property
    def ids(self) -> list[int]:
        return list(self._ids)

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        before = decode(self._ids[self._prefix : self._read])
        after = decode(self._ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd") or not after.startswith(before):
            return ""
        piece = after[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._emitted.append(piece)
        return piece

    def finish(self) -> str:
        """The text not yet returned (a held-back tail), reconciled with the full decode."""
        full = self._tokenizer.decode(self._ids)
        sent = "".join(self._emitted)
        rest = full[len(sent) :] if full.startswith(sent) else ""
        self._emitted.append(rest)
        self._prefix = self._read = len(self._ids)
        return rest


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _raise_template_error(message: str) -> None:
    from jinja2 import TemplateError

    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    from datetime import datetime

    return datetime.now().strftime(fmt)


def _read_tokenizer_config(directory: Path) -> dict[str, Any]:
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"{path} is not readable JSON ({exc})") from None
    return config if isinstance(config, dict) else {}


def _chat_template_source(directory: Path, config: dict[str, Any]) -> str:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str) and template:
        return template
    standalone = directory / "chat_template.jinja"  # where newer transformers save it
    if standalone.is_file():
        return standalone.read_text(encoding="utf-8")
    raise ModelError(f"{directory}: no chat template (tokenizer_config.json has no "
                     "chat_template and there is no chat_template.jinja)")


def _special_token_strings(config: dict[str, Any]) -> dict[str, str | None]:
    tokens: dict[str, str | None] = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = config.get(key)
        if isinstance(value, dict):  # AddedToken serialised as a dict
            value = value.get("content")
        tokens[key] = value if isinstance(value, str) else None
    return tokens
