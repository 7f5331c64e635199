"""The tokenizer: chat template parity with transformers, template errors and sandboxing,
streaming detokenization, and the thinking/answer split of a reply."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from qwenchat.errors import ModelError
from qwenchat.model.tokenizer import ChatTemplate, Message, PrefixReuse, Tokenizer
from qwenchat.session import ThinkSplitter

IM_START_ID = 151644
IM_END_ID = 151645
END_OF_TEXT_ID = 151643
THINK_START_ID = 151667
THINK_END_ID = 151668

CONVERSATIONS = {
    "single_user": [Message("user", "Hello there")],
    "system_and_user": [
        Message("system", "You are a terse assistant."),
        Message("user", "Name a prime number."),
    ],
    "multi_turn_with_thinking": [
        Message("system", "Be helpful."),
        Message("user", "What is 2+2?"),
        Message("assistant", "<think>\nTwo plus two.\nThat is four.\n</think>\n\n4"),
        Message("user", "And 3+3?"),
        Message("assistant", "<think>\nThree plus three.\n</think>\n\nIt is 6."),
        Message("user", "Thanks! /no_think"),
    ],
    "ends_with_assistant_thinking": [
        Message("user", "Why is the sky blue?"),
        Message("assistant",
                "<think>\nRayleigh scattering.\n</think>\n\nShort wavelengths scatter."),
    ],
    "non_ascii": [
        Message("system", "Réponds en français, s'il te plaît."),
        Message("user", "你好，世界！👍🏽 👨‍👩‍👧 🇯🇵 café naïve {{ not jinja }} \\n"),
        Message("assistant", "<think>\n考えています 🤔\n</think>\n\nこんにちは 😀"),
        Message("user", "Ещё раз, пожалуйста 🫠"),
    ],
}

# Strings whose characters a byte-level BPE may split across tokens.
STREAM_TEXTS = [
    "你好🫠龘",
    "你好，世界。今天天气很好。",
    "Thumbs 👍🏽, family 👨‍👩‍👧, flags 🇯🇵🇫🇷🏳️‍🌈, hearts ❤️",
    "café naïve über señor Ærøskøbing ẞ ǅ",
    "def add(a, b):\n    return a + b  # sum\n\n\tprint(add(1, 2))\r\n",
    "𝄞 music, 𠀀 ext-B, 𓀀 hieroglyph, ꙮ multiocular o",
    "Mixed: αβγ δ — “quotes” … 🚀🎉\n\n",
    "\n\n\n",
]


# ---------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def tiny_tok(tiny_model_dir) -> Tokenizer:
    return Tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def real_tok(real_tokenizer_dir) -> Tokenizer:
    return Tokenizer(real_tokenizer_dir)


@pytest.fixture(params=["tiny", "real"])
def any_tok(request) -> Tokenizer:
    return request.getfixturevalue(f"{request.param}_tok")


def _hf_tokenizer(directory: Path):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(directory))


def _stream(tokenizer: Tokenizer, ids: list[int]) -> tuple[list[str], str]:
    """Pieces returned by push (empty ones dropped) and the finish() tail."""
    decoder = tokenizer.stream_decoder()
    pieces = [piece for piece in (decoder.push(i) for i in ids) if piece]
    return pieces, decoder.finish()


def _assert_pieces_tile(full: str, pieces: list[str]) -> None:
    """Each piece is the text of `full` at its own offset, and together they are all of it."""
    offset = 0
    for n, piece in enumerate(pieces):
        assert full[offset : offset + len(piece)] == piece, (
            f"piece {n} {piece!r} is not the final text at offset {offset}: "
            f"{full[offset : offset + len(piece)]!r}")
        offset += len(piece)
    assert offset == len(full), f"pieces cover {offset} of {len(full)} characters"


def _write_tokenizer_dir(directory: Path, tiny_tokenizer, config: dict,
                         jinja: str | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    tiny_tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (directory / "chat_template.jinja").write_text(jinja, encoding="utf-8")
    return directory


# ---------------------------------------------------------------------- chat template


@pytest.fixture(scope="module", params=["tiny", "real"])
def ours_and_hf(request):
    """Our tokenizer and transformers' one, loaded once per directory."""
    directory = request.getfixturevalue("tiny_model_dir" if request.param == "tiny"
                                        else "real_tokenizer_dir")
    return Tokenizer(directory), _hf_tokenizer(directory)


@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["gen", "nogen"])
@pytest.mark.parametrize("enable_thinking", [True, False], ids=["think", "nothink"])
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
def test_chat_template_renders_exactly_what_transformers_renders(
        ours_and_hf, conversation, enable_thinking, add_generation_prompt):
    ours, hf = ours_and_hf
    messages = CONVERSATIONS[conversation]
    expected = hf.apply_chat_template(
        [m.as_dict() for m in messages], tokenize=False,
        add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking)
    got = ours.render(messages, enable_thinking=enable_thinking,
                      add_generation_prompt=add_generation_prompt)
    assert got.encode("utf-8") == expected.encode("utf-8")


def test_encode_chat_gives_the_ids_transformers_gives_for_the_rendered_prompt(ours_and_hf):
    ours, hf = ours_and_hf
    messages = CONVERSATIONS["non_ascii"]
    rendered = hf.apply_chat_template([m.as_dict() for m in messages], tokenize=False,
                                      add_generation_prompt=True, enable_thinking=False)
    expected = hf(rendered, add_special_tokens=False)["input_ids"]
    assert ours.encode_chat(messages, enable_thinking=False) == list(expected)


def test_real_template_prefills_an_empty_think_block_only_without_thinking(real_tok):
    messages = CONVERSATIONS["system_and_user"]
    no_think = real_tok.render(messages, enable_thinking=False)
    think = real_tok.render(messages, enable_thinking=True)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert think.endswith("<|im_start|>assistant\n")
    assert "<think>" not in think


def test_real_template_drops_the_reasoning_of_earlier_assistant_turns(real_tok):
    rendered = real_tok.render(CONVERSATIONS["multi_turn_with_thinking"], enable_thinking=True)
    assert "Two plus two" not in rendered and "Three plus three" not in rendered
    assert "<|im_start|>assistant\n4<|im_end|>\n" in rendered
    assert "<|im_start|>assistant\nIt is 6.<|im_end|>\n" in rendered


def test_real_encode_chat_starts_with_im_start_and_adds_no_bos(real_tok):
    ids = real_tok.encode_chat(CONVERSATIONS["system_and_user"], enable_thinking=False)
    assert ids[0] == IM_START_ID
    assert END_OF_TEXT_ID not in ids
    assert ids[-4:] == real_tok.encode("<think>\n\n</think>\n\n")


def test_real_tokenizer_knows_qwen3_special_ids(real_tok):
    assert real_tok.think_start_id == THINK_START_ID
    assert real_tok.think_end_id == THINK_END_ID
    assert real_tok.im_end_id == IM_END_ID
    assert real_tok.end_of_text_id == END_OF_TEXT_ID
    assert real_tok.encode("<|im_start|>") == [IM_START_ID]
    assert real_tok.encode("<think>x</think>")[0] == THINK_START_ID
    assert real_tok.encode("<think>x</think>")[-1] == THINK_END_ID


def test_template_with_a_syntax_error_is_a_model_error():
    with pytest.raises(ModelError, match="chat template does not compile"):
        ChatTemplate("{% for message in messages %}{{ message.content }}", {})


def test_tokenizer_dir_with_a_broken_template_is_a_model_error(tmp_path, tiny_tokenizer):
    directory = _write_tokenizer_dir(tmp_path / "m", tiny_tokenizer,
                                     {"chat_template": "{% if %}oops{% endif %}"})
    with pytest.raises(ModelError, match="chat template does not compile"):
        Tokenizer(directory)


def test_template_raise_exception_becomes_a_model_error_with_its_message():
    template = ChatTemplate(
        "{% for m in messages %}{% if m.role == 'tool' %}"
        "{{ raise_exception('Conversation roles must be user or assistant') }}"
        "{% endif %}{{ m.content }}{% endfor %}", {})
    assert template.render([Message("user", "ok")]) == "ok"
    with pytest.raises(ModelError, match="roles must be user or assistant"):
        template.render([Message("tool", "x")])


def test_directory_without_any_chat_template_is_a_model_error(tmp_path, tiny_tokenizer):
    directory = _write_tokenizer_dir(tmp_path / "m", tiny_tokenizer, {"eos_token": "<|im_end|>"})
    with pytest.raises(ModelError, match="no chat template") as info:
        Tokenizer(directory)
    assert "chat_template.jinja" in str(info.value)


def test_chat_template_jinja_is_used_when_tokenizer_config_has_none(tmp_path, tiny_tokenizer):
    jinja = ("{% for m in messages %}[{{ m.role }}|{{ m.content }}]{% endfor %}"
             "{% if add_generation_prompt %}<{{ eos_token }}>{% endif %}")
    directory = _write_tokenizer_dir(tmp_path / "m", tiny_tokenizer,
                                     {"eos_token": "<|im_end|>"}, jinja=jinja)
    rendered = Tokenizer(directory).render([Message("user", "hé")], enable_thinking=True)
    assert rendered == "[user|hé]<<|im_end|>>"


def test_tokenizer_config_template_wins_over_chat_template_jinja(tmp_path, tiny_tokenizer):
    directory = _write_tokenizer_dir(tmp_path / "m", tiny_tokenizer,
                                     {"chat_template": "from-config"}, jinja="from-jinja-file")
    assert Tokenizer(directory).render([Message("user", "x")], enable_thinking=True) == \
        "from-config"


# Indented blocks without "-" (trim_blocks/lstrip_blocks matter), loop controls and tojson.
INDENTED_TEMPLATE = """\
{% for message in messages %}
    {% if message.role == 'system' %}
        {% continue %}
    {% endif %}
    <|im_start|>{{ message.role }}
    {{ message.content | tojson }}
    {% if loop.index > 3 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}
  <|im_start|>assistant{{ eos_token }}
{% endif %}
"""


def test_chat_template_jinja_matches_transformers(tmp_path, tiny_tokenizer):
    directory = _write_tokenizer_dir(tmp_path / "m", tiny_tokenizer,
                                     {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
                                     jinja=INDENTED_TEMPLATE)
    hf = _hf_tokenizer(directory)
    messages = CONVERSATIONS["non_ascii"] + CONVERSATIONS["multi_turn_with_thinking"]
    expected = hf.apply_chat_template([m.as_dict() for m in messages], tokenize=False,
                                      add_generation_prompt=True)
    assert "你好" in expected and "Réponds" not in expected  # tojson kept it; continue worked
    assert Tokenizer(directory).render(messages, enable_thinking=True) == expected


def test_named_template_list_uses_the_default_entry(tmp_path, tiny_tokenizer):
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
    directory = _write_tokenizer_dir(tmp_path / "m", tiny_tokenizer, {"chat_template": named})
    assert Tokenizer(directory).render([Message("user", "x")], enable_thinking=True) == "plain"


def test_tojson_keeps_non_ascii_text_like_transformers():
    template = ChatTemplate("{{ messages[0] | tojson }}", {})
    assert template.render([Message("user", "你好 😀")]) == \
        '{"role": "user", "content": "你好 😀"}'


@pytest.mark.parametrize("source", [
    "{{ messages.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ messages.append({'role': 'user', 'content': 'injected'}) }}",
    "{% set _ = messages.pop() %}{{ messages | length }}",
])
def test_sandbox_refuses_unsafe_access_with_a_model_error(source):
    template = ChatTemplate(source, {})
    messages = [Message("user", "hi")]
    with pytest.raises(ModelError, match="unsafe"):
        template.render(messages)
    assert messages == [Message("user", "hi")]


@pytest.mark.parametrize("source", [
    "{{ ''.__class__ }}",
    "{{ messages[0].__class__ }}",
    "{{ '' | attr('__class__') }}",
])
def test_sandbox_renders_nothing_for_a_lone_dunder_attribute(source):
    try:
        rendered = ChatTemplate(source, {}).render([Message("user", "hi")])
    except ModelError:
        return  # refusing outright is fine too
    assert rendered == ""


# ---------------------------------------------------------------------- StreamDecoder


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_stream_pieces_of_encoded_text_are_the_decode_and_never_partial(any_tok, text):
    ids = any_tok.encode(text)
    full = any_tok.decode(ids)
    assert "\ufffd" not in full
    decoder = any_tok.stream_decoder()
    emitted = ""
    for k, token in enumerate(ids, start=1):
        piece = decoder.push(token)
        assert "\ufffd" not in piece
        emitted += piece
        so_far = any_tok.decode(ids[:k])
        assert so_far.startswith(emitted)
        if not so_far.endswith("\ufffd"):  # held back only while a character is incomplete
            assert emitted == so_far
    emitted += decoder.finish()
    assert emitted == full


def test_stream_never_emits_half_a_character_when_tokens_split_one(real_tok):
    text = "你好🫠龘"
    ids = real_tok.encode(text)
    lone = [real_tok.decode([i]) for i in ids]
    assert any("\ufffd" in piece for piece in lone), "premise: some token holds part of a char"
    pieces, tail = _stream(real_tok, ids)
    assert tail == ""
    assert pieces == ["你好", "🫠", "龘"]
    _assert_pieces_tile(text, pieces)


@pytest.mark.parametrize("seed", range(6))
def test_stream_of_random_ids_concatenates_to_the_full_decode(any_tok, seed):
    rng = np.random.default_rng(seed)
    length = int(rng.integers(1, 301))
    ids = [int(i) for i in rng.integers(0, any_tok.vocab_size, size=length)]
    full = any_tok.decode(ids)
    pieces, tail = _stream(any_tok, ids)
    assert not any(piece.endswith("\ufffd") for piece in pieces)
    _assert_pieces_tile(full, [*pieces, tail])


@pytest.mark.parametrize("seed", range(4))
def test_stream_of_random_byte_tokens_concatenates_to_the_full_decode(tiny_tok, seed):
    # Only the tiny vocab's 256 single-byte tokens: mostly broken UTF-8.
    byte_ids = [i for i in range(tiny_tok.vocab_size)
                if len(tiny_tok.id_to_token(i) or "") == 1]
    assert len(byte_ids) >= 256
    rng = np.random.default_rng(100 + seed)
    ids = [int(i) for i in rng.choice(byte_ids, size=300)]
    full = tiny_tok.decode(ids)
    assert "\ufffd" in full, "premise: random bytes are broken UTF-8"
    pieces, tail = _stream(tiny_tok, ids)
    _assert_pieces_tile(full, [*pieces, tail])


def test_stream_skips_special_tokens_like_decode(any_tok):
    specials = [any_tok.im_end_id, any_tok.end_of_text_id,
                any_tok.encode("<|im_start|>")[0]]
    ids: list[int] = []
    for n, text in enumerate(["Hello", " 你好🫠", " world\n", "龘!"]):
        ids += [*any_tok.encode(text), specials[n % len(specials)]]
    ids = specials + ids
    full = any_tok.decode(ids)
    assert "<|im_end|>" not in full and "<|endoftext|>" not in full
    pieces, tail = _stream(any_tok, ids)
    _assert_pieces_tile(full, [*pieces, tail])
    assert "".join(pieces) + tail == "Hello 你好🫠 world\n龘!"


def test_stream_special_token_between_bytes_of_one_character(real_tok):
    first, second = real_tok.encode("龘")
    ids = [first, IM_END_ID, second]
    pieces, tail = _stream(real_tok, ids)
    _assert_pieces_tile(real_tok.decode(ids), [*pieces, tail])


def test_stream_keeps_think_markers_as_text_like_decode(any_tok):
    ids = any_tok.encode("<think>\nhmm\n</think>\n\nyes")
    assert any_tok.think_start_id in ids
    pieces, tail = _stream(any_tok, ids)
    assert "".join(pieces) + tail == any_tok.decode(ids) == "<think>\nhmm\n</think>\n\nyes"


def test_stream_decoder_remembers_every_id(any_tok):
    ids = any_tok.encode("abc 😀")
    decoder = any_tok.stream_decoder()
    for token in ids:
        decoder.push(token)
    assert decoder.ids == ids


# ---------------------------------------------------------------------- ThinkSplitter


def _split(tokenizer: Tokenizer, ids: list[int], parse_thinking: bool) -> dict[str, str]:
    splitter = ThinkSplitter(tokenizer, parse_thinking)
    pieces = [p for token in ids for p in splitter.push(token)] + splitter.finish()
    assert all(p.text for p in pieces)
    text = {"thinking": "", "answer": ""}
    for piece in pieces:
        text[piece.kind] += piece.text
    return text


def test_think_splitter_routes_reasoning_and_answer(any_tok):
    ids = any_tok.encode("<think>\nreasoning\n</think>\n\nanswer")
    assert ids[0] == any_tok.think_start_id
    text = _split(any_tok, ids, parse_thinking=True)
    assert text["thinking"].rstrip("\n") == "reasoning"
    assert text["answer"] == "answer"


def test_think_splitter_strips_newlines_split_over_several_tokens(any_tok):
    newline = any_tok.encode("\n")
    ids = ([any_tok.think_start_id] + newline * 3 + any_tok.encode("思考 🫠")
           + [any_tok.think_end_id] + newline * 2 + any_tok.encode("\n答え"))
    text = _split(any_tok, ids, parse_thinking=True)
    assert text["thinking"] == "思考 🫠"
    assert text["answer"] == "答え"


def test_think_splitter_without_parsing_gives_the_plain_decode(any_tok):
    ids = any_tok.encode("<think>\nreasoning\n</think>\n\nanswer")
    text = _split(any_tok, ids, parse_thinking=False)
    assert text["thinking"] == ""
    assert text["answer"] == any_tok.decode(ids) == "<think>\nreasoning\n</think>\n\nanswer"


def test_think_splitter_answer_only_reply_is_all_answer(any_tok):
    ids = any_tok.encode("Just an answer, 答え.")
    text = _split(any_tok, ids, parse_thinking=True)
    assert text == {"thinking": "", "answer": "Just an answer, 答え."}


# ----------------------------------------------------- re-encoding a growing conversation
PIECES = ["The fox", " jumps", "\n\n", "狐狸", " 😀", " café", "```py\nx = 1\n```", "  ",
          "<|im_end|>", "<think>", "</think>", "\r\n", "naïve", "\u0301e"]


def random_text(rng, n: int) -> str:
    return "".join(PIECES[rng.integers(len(PIECES))] for _ in range(n))


@pytest.mark.parametrize("thinking", [False, True])
def test_reusing_an_earlier_prefix_encodes_exactly_as_a_fresh_encode(any_tok, thinking,
                                                                     monkeypatch):
    rng = np.random.default_rng(3)
    reuse = PrefixReuse(any_tok)
    encoded: list[int] = []  # characters actually handed to the tokenizer, per encode
    encode_with_cuts = any_tok.encode_with_cuts

    def counting(text):
        encoded.append(len(text))
        return encode_with_cuts(text)

    monkeypatch.setattr(any_tok, "encode_with_cuts", counting)
    messages = [Message("system", random_text(rng, 5))]
    for turn in range(12):
        messages.append(Message("user", random_text(rng, 8)))
        probes = [[*messages, Message("user", text)] for text in ("1", "2")]
        for candidate in (*probes, messages):  # what a session renders each turn
            text = any_tok.render(candidate, thinking)
            assert reuse.encode(text) == any_tok.encode(text)
        if turn >= 2:  # only what is new was encoded
            assert encoded[-1] < len(text) / 2
        messages.append(Message("assistant", random_text(rng, 30)))
        if turn % 4 == 3:  # an edit: the last exchange replaced
            messages[-2:] = [Message("user", random_text(rng, 6))]
        if turn == 7:  # a new system prompt: nothing before it can be reused
            messages[0] = Message("system", random_text(rng, 4))


def test_cuts_split_the_text_into_parts_that_encode_on_their_own(any_tok):
    text = any_tok.render([Message("system", "Be brief. 简洁。"), Message("user", "Hi 😀"),
                           Message("assistant", "Hello!\n\n- a\n- b"), Message("user", "x")],
                          enable_thinking=False)
    ids, cuts = any_tok.encode_with_cuts(text)
    assert cuts and ids == any_tok.encode(text)
    for chars, tokens in cuts:
        assert any_tok.encode(text[:chars]) == ids[:tokens]
        assert any_tok.encode(text[chars:]) == ids[tokens:]


# ------------------------------------------------------------------ long texts, in pieces
# Fragments a long text is drawn from: every kind of character Qwen's pre-tokenizer treats on
# its own (letters, digits, punctuation runs, contractions, spaces, tabs, newlines, Unicode
# spaces and line ends, combining marks NFC composes, CJK, emoji) and the added tokens.
FRAGMENTS = ["word", "Word", " the", "  two", "\t", "\ttab", " ", "   ", "\n", "\n\n", "\r\n",
             " \n", "\t\n ", "'s", "'LL", "it's", "42", " 7", "3.14", "(", "))", " {", "...",
             "?!\n", ".\n\n", "# ", "café", "e\u0301", " \u0301", "a\u0308\u0323", "한\u1161",
             "你好，世界。", " 中文", "🫠", " 👍🏽", "\u00a0", "\u3000x", "\u2028", "\u0085",
             "\x1c", "\u200b", "Ⅻ", " ²", "<|im_start|>", "<|im_end|>\n", "<think>", "_x"]


def _random_long_text(rng, fragments: int) -> str:
    return "".join(FRAGMENTS[i] for i in rng.integers(0, len(FRAGMENTS), fragments))


def _whole(tok: Tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """The ids and cuts of `text` encoded in one call, as encode_with_cuts made them before it
    encoded long texts in pieces."""
    encoding = tok._tok.encode(text, add_special_tokens=False)
    cuts = [(end, i + 1) for i, ((_, end), token) in enumerate(zip(encoding.offsets,
                                                                    encoding.ids, strict=True))
            if token in tok._cut_after_ids]
    return encoding.ids, cuts


@pytest.mark.parametrize("seed", range(8))
def test_a_long_text_encodes_in_pieces_to_the_whole_texts_ids_and_cuts(real_tok, seed):
    text = _random_long_text(np.random.default_rng(seed), 3000)
    assert len(real_tok._encoded_parts(text)) > 4, "premise: the text is cut"
    ids, cuts = _whole(real_tok, text)
    assert real_tok.encode(text) == ids
    assert real_tok.encode_with_cuts(text) == (ids, cuts)


def test_python_sources_encode_in_pieces_to_the_whole_texts_ids(real_tok):
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join(stdlib.joinpath(name).read_text(encoding="utf-8")
                   for name in ("textwrap.py", "tokenize.py", "calendar.py"))
    rng = np.random.default_rng(0)
    for start in [0, *rng.integers(1, len(text) - 20_000, 5)]:  # windows begun anywhere
        part = text[start : start + 20_000]
        assert len(real_tok._encoded_parts(part)) > 10, "premise: the text is cut"
        assert real_tok.encode(part) == _whole(real_tok, part)[0]


def test_a_tokenizer_not_qwens_encodes_whole(tiny_tok, real_tok):
    assert real_tok._pieces_exact
    assert not tiny_tok._pieces_exact  # another pre-tokenizer: no cut is known to be exact
    text = "word " * 1000
    assert len(tiny_tok._encoded_parts(text)) == 1
    assert tiny_tok.encode(text) == tiny_tok._tok.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("added", [dict(content="<a b>"), dict(content="<x>", lstrip=True),
                                   dict(content="<y>", rstrip=True)])
def test_an_added_token_that_holds_or_takes_whitespace_keeps_texts_whole(real_tokenizer_dir,
                                                                         added):
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from qwenchat.model.tokenizer import _pieces_exact

    tok = HFTokenizer.from_file(str(real_tokenizer_dir / "tokenizer.json"))
    assert _pieces_exact(tok)
    tok.add_special_tokens([AddedToken(**added)])
    assert not _pieces_exact(tok)  # (a cut could fall inside it, or beside what it takes)
