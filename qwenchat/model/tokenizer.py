"""The model's own tokenizer.json and chat template, and a streaming detokenizer."""

from __future__ import annotations

import bisect
import json
import re
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

# A long text encodes as pieces on the tokenizer's own threads (encode_batch, which also lets go
# of Python's lock): 16K tokens in 7.9 ms against 40.6 ms whole on the H100's host (16 cores),
# 6.9 against 25 ms on two (docs/perf.md). Exactly the whole text's
# ids, because it is cut only where Qwen's pre-tokenizer (QWEN_PRE_TOKENIZER) ends a pre-token
# whatever follows, and its pieces are what BPE works on: after a newline before a non-space
# (no alternative continues a newline into a non-space), and between a non-space and a space
# or tab (none continues a non-space into a space). Python's whitespace holds all of Unicode's
# (White_Space), so "non-space" here is one for the tokenizer's regex too. NFC composes
# neither across a newline nor into a space, and no added token holds whitespace (checked:
# `Tokenizer._pieces_exact`), so none is cut.
_PIECE_CUT = re.compile(r"(?<=\n)(?=\S)|(?<=\S)(?=[ \t])")
PIECE_CHARS = 512  # a piece's least length; a text under twice this encodes whole
QWEN_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Split", "behavior": "Isolated", "invert": False, "pattern": {
            "Regex": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| "
                     r"?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"}},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
         "use_regex": False}]}


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
        self._pieces_exact = _pieces_exact(self._tok)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def same_vocabulary(self, other: Tokenizer) -> bool:
        """Whether both map every token to the same id (a draft model's must be the target's)."""
        return (self.vocab_size == other.vocab_size
                and self._tok.get_vocab(with_added_tokens=True)
                == other._tok.get_vocab(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        parts = self._encoded_parts(text)
        if len(parts) == 1:
            return parts[0][1].ids
        return [i for _, encoding in parts for i in encoding.ids]

    def _encoded_parts(self, text: str) -> list[tuple[int, Any]]:
        """(start, tokenizers.Encoding) of each piece of `text`, in order (see _PIECE_CUT)."""
        starts = [0]
        if self._pieces_exact:
            while len(text) - starts[-1] >= 2 * PIECE_CHARS:
                cut = _PIECE_CUT.search(text, starts[-1] + PIECE_CHARS, len(text) - PIECE_CHARS)
                if cut is None:
                    break
                starts.append(cut.start())
        if len(starts) == 1:
            return [(0, self._tok.encode(text, add_special_tokens=False))]
        pieces = [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)], strict=True)]
        return list(zip(starts, self._tok.encode_batch(pieces, add_special_tokens=False),
                        strict=True))

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
        cut_after = self._cut_after_ids
        ids: list[int] = []
        cuts: list[tuple[int, int]] = []
        for start, encoding in self._encoded_parts(text):
            cuts += [(start + end, len(ids) + i + 1)
                     for i, ((_, end), token) in enumerate(zip(encoding.offsets, encoding.ids,
                                                               strict=True))
                     if token in cut_after]
            ids += encoding.ids
        return ids, cuts

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


def _pieces_exact(tok: Any) -> bool:
    """Whether a text cut at _PIECE_CUT encodes, piece by piece, to the whole one's ids with
    this tokenizer: Qwen's pre-tokenizer, NFC or no normalizer, and added tokens that hold no
    whitespace and take none from beside them."""
    try:
        pre = json.loads(tok.pre_tokenizer.__getstate__()) if tok.pre_tokenizer else None
        norm = json.loads(tok.normalizer.__getstate__()) if tok.normalizer else None
    except (AttributeError, TypeError, ValueError):
        return False
    added = tok.get_added_tokens_decoder().values()
    return (pre == QWEN_PRE_TOKENIZER and norm in (None, {"type": "NFC"})
            and not any(a.lstrip or a.rstrip or a.single_word or
                        any(c.isspace() for c in a.content) for a in added))


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
