"""Tokenizer and chat template: SmolLM2's against transformers' GGUF tokenizer, and the edge cases."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pdserve.engine.registry import DEFAULT_MODEL, resolve_model
from pdserve.engine.tokenizer import Tokenizer
from tests.tiny_gguf import write_tiny_gguf
from tests.tiny_models import make_tiny_model

TEXTS = [
    "Hello world",
    "  leading spaces and trailing   ",
    "tabs\tand\nnewlines\r\n\n\nblank lines",
    "digits 1234567890 3.14159 1,000,000 2024-06-01",
    "unicode: café naïve Ærøskøbing 日本語のテキスト 中文 한국어 Ελληνικά русский",
    "emoji 😀👍🏽 👨‍👩‍👧‍👦 flags 🇫🇷",
    "def f(x):\n    return {'a': [x ** 2 for x in range(10)]}  # comment\n",
    "<|im_start|>user\nspecial tokens inline<|im_end|><|endoftext|>",
    "almost special <|im_start and <|im_end |> <repo_name>",
    "punctuation!!! ??? ... ,,, ;;; --- ___ *** ''' \"\"\"",
    "I'm you're they'll we've he'd it's DON'T",
    "",
    " ",
    "a" * 300,
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi! 😀"}],
    [
        {"role": "user", "content": "Write a haiku about rain."},
        {"role": "assistant", "content": "Soft rain on the roof"},
        {"role": "user", "content": "Another one, in 日本語."},
    ],
    [{"role": "user", "content": "  spaces\n\nand newlines  "}],
]


# Loading transformers' tokenizer from the GGUF is the slow part: `make test-fast` skips the comparisons.
slow_reference = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_dir(smollm2_cache) -> Path:
    return resolve_model(DEFAULT_MODEL, smollm2_cache, progress=False)


@pytest.fixture(scope="module")
def ours(smollm2_dir) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


@pytest.fixture(scope="module")
def reference(smollm2_hf_tokenizer):
    return smollm2_hf_tokenizer


@slow_reference
def test_tokenizer_json_equals_transformers(ours, reference):
    assert json.loads(ours.backend.to_str()) == json.loads(reference.backend_tokenizer.to_str())


@slow_reference
def test_attributes(ours, reference):
    assert ours.vocab_size == len(reference) == 49152
    assert ours.bos_token_id == reference.bos_token_id == 1
    assert ours.eos_token_ids == (reference.eos_token_id,) == (2,)


@slow_reference
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_equals_transformers(ours, reference, add_special_tokens):
    for text in TEXTS:
        expected = reference(text, add_special_tokens=add_special_tokens)["input_ids"]
        assert ours.encode(text, add_special_tokens=add_special_tokens) == expected, text


@slow_reference
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_equals_transformers(ours, reference, skip_special_tokens):
    import random

    rng = random.Random(0)
    id_lists = [reference(text)["input_ids"] for text in TEXTS]
    id_lists += [[rng.randrange(ours.vocab_size) for _ in range(40)] for _ in range(20)]
    for ids in id_lists:
        assert ours.decode(ids, skip_special_tokens) == reference.decode(
            ids, skip_special_tokens=skip_special_tokens
        )


@slow_reference
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_transformers(ours, reference, add_generation_prompt):
    for chat in CHATS:
        text = reference.apply_chat_template(
            chat, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        assert ours.render_chat(chat, add_generation_prompt) == text
        ids = reference.apply_chat_template(chat, add_generation_prompt=add_generation_prompt, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert ours.apply_chat_template(chat, add_generation_prompt) == list(ids)


def test_default_system_prompt_and_generation_prompt(ours):
    text = ours.render_chat([{"role": "user", "content": "hi"}])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")


def test_decode_stream_matches_decode(ours):
    for text in TEXTS + ["Hi<|im_end|>there"]:
        ids = ours.encode(text)
        for skip in (True, False):
            stream = ours.decode_stream(skip_special_tokens=skip)
            assert "".join(stream.step(i) for i in ids) == ours.decode(ids, skip_special_tokens=skip), text


def test_decode_stream_holds_incomplete_characters(ours):
    ids = ours.encode("😀")
    assert len(ids) > 1  # a 4-byte character spread over byte tokens
    stream = ours.decode_stream()
    pieces = [stream.step(i) for i in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == "😀"


def test_a_stream_primed_with_the_prompt_continues_it(ours):
    """Output text is what the prompt's tokens plus the output's decode to, past the prompt's own text: a
    prompt whose last token began a multi-byte character has it completed by the output (it was a U+FFFD
    on the router, whose stream was not primed), and a word start keeps its space."""
    ids = ours.encode("Say 好 and 😀 please")
    cut = next(i for i in range(1, len(ids)) if "\ufffd" in ours.decode(ids[:i]))  # inside a character
    prompt, out = ids[:cut], ids[cut:]
    stream = ours.decode_stream(prompt_token_ids=prompt)
    text = "".join(stream.step(i) for i in out)
    # (the character's whole token comes out with it, here its leading space as well)
    assert "\ufffd" not in text and text.lstrip() == "好 and 😀 please"
    words = ours.encode("the cat sat")
    stream = ours.decode_stream(prompt_token_ids=words[:2])
    assert "".join(stream.step(i) for i in words[2:]) == " sat"


@pytest.mark.parametrize(
    ("messages", "problem"),
    [
        ([{"role": "tool", "content": "x"}], "role 'tool'"),
        ([{"role": "User", "content": "x"}], "role 'User'"),
        ([], "empty"),
        ("hello", "list"),
        ({"role": "user", "content": "x"}, "list"),
        ([{"content": "x"}], "role"),
        ([{"role": "user"}], "content"),
        ([{"role": "user", "content": 5}], "content"),
        ([{"role": "user", "content": "x", "name": 3}], "name"),
        (["user: hi"], "mapping"),
    ],
)
def test_bad_messages_are_value_errors_naming_the_problem(ours, messages, problem):
    with pytest.raises(ValueError, match=problem):
        ours.apply_chat_template(messages)


def test_none_values_count_as_absent(ours):
    plain = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(
        [{"role": "user", "content": "hi", "name": None}]
    ) == ours.apply_chat_template(plain)


def test_directory_without_tokenizer_raises_file_not_found(tiny_llama_dir):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tiny_llama_dir)


@pytest.fixture()
def tiny_tok_dir(tmp_path) -> Path:
    """A converted tiny GGUF (byte-level BPE, add_bos_token, ChatML), copied so tests may edit it."""
    gguf = write_tiny_gguf(make_tiny_model("llama", tmp_path / "hf"), tmp_path / "tiny.gguf")
    converted = resolve_model(str(gguf), tmp_path / "cache", progress=False)
    copy = tmp_path / "tok"
    shutil.copytree(converted, copy)
    return copy


def test_tiny_tokenizer_bos_and_eos_sources(tiny_tok_dir):
    tok = Tokenizer.from_dir(tiny_tok_dir)
    assert tok.encode("the")[0] == tok.bos_token_id == 1
    assert tok.encode("the", add_special_tokens=False)[0] != 1
    # the tokenizer's EOS first, then every stop id of generation_config.json, deduplicated
    (tiny_tok_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2, 7]}))
    assert Tokenizer.from_dir(tiny_tok_dir).eos_token_ids == (2, 0, 7)


def test_template_features_like_transformers(tiny_tok_dir):
    config = json.loads((tiny_tok_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' and loop.first %}"
        "{{ raise_exception('conversation must not start with the assistant') }}{% endif %}"
        "{% generation %}{{ m['role'] | upper }}: {{ m['content'] | tojson }}{% endgeneration %}\n"
        "{% endfor %}"
    )
    config["pdserve_chat_roles"] = ["user", "assistant", "tool"]
    (tiny_tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_dir(tiny_tok_dir)
    chat = [{"role": "tool", "content": "é<b>"}, {"role": "user", "content": "x"}]
    # trim_blocks eats the newline after a block tag; tojson neither escapes HTML nor non-ASCII
    assert tok.render_chat(chat, False) == '<|im_start|>TOOL: "é<b>"USER: "x"'
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[chat],
        chat_template=config["chat_template"],
        add_generation_prompt=False,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
    )
    assert tok.render_chat(chat, False) == rendered[0]
    with pytest.raises(ValueError, match="must not start with the assistant"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])
    # chat_template.jinja (transformers 5's separate file) wins over the config entry
    (tiny_tok_dir / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert Tokenizer.from_dir(tiny_tok_dir).render_chat([{"role": "user", "content": "a"}]) == "[a]"


def test_template_is_sandboxed_and_errors_are_value_errors(tiny_tok_dir):
    config_path = tiny_tok_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for template, problem in (
        ("{{ messages.append({'role': 'user'}) }}", "rejected"),
        ("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}", "rejected"),
        ("{% for m in messages %}", "does not parse"),
    ):
        config["chat_template"] = template
        config_path.write_text(json.dumps(config))
        with pytest.raises(ValueError, match=problem):
            Tokenizer.from_dir(tiny_tok_dir).apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_chat_template_is_a_value_error(tiny_tok_dir):
    config_path = tiny_tok_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["chat_template"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_dir(tiny_tok_dir).apply_chat_template([{"role": "user", "content": "x"}])


@slow_reference
def test_vocab_digest_names_the_vocabulary_not_the_files(ours, reference, smollm2_dir, tmp_path):
    """What the router compares at registration (``Tokenizer.vocab_digest``): the same for the same model
    however it was loaded or saved, different once one token differs."""
    # transformers' own loading of the packaged GGUF: the same ids and strings, so the same digest
    assert Tokenizer(reference.backend_tokenizer, special_tokens={}).vocab_digest == ours.vocab_digest
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("tokenizer_config.json", "config.json"):
        shutil.copy(smollm2_dir / name, copy / name)
    ours.backend.save(str(copy / "tokenizer.json"), pretty=False)  # other bytes, same vocabulary
    assert (copy / "tokenizer.json").read_bytes() != (smollm2_dir / "tokenizer.json").read_bytes()
    assert Tokenizer.from_dir(copy).vocab_digest == ours.vocab_digest
    backend = ours.backend.__class__.from_file(str(copy / "tokenizer.json"))
    backend.add_tokens(["<one-more>"])
    backend.save(str(copy / "tokenizer.json"))
    assert Tokenizer.from_dir(copy).vocab_digest != ours.vocab_digest
    assert len(ours.vocab_digest) == 16 and int(ours.vocab_digest, 16) >= 0


def test_long_texts_encode_as_short_ones_do_without_holding_the_gil(ours):
    """Past ``_GIL_HELD_CHARS`` a text goes through ``encode_batch``, which releases the GIL: the same ids,
    and a thread of the same process keeps running meanwhile (``encode`` held it for the whole text,
    so a router tokenizing a long prompt off its event loop still stopped the loop: missed heartbeats)."""
    import threading
    import time

    from pdserve.engine import tokenizer as tokenizer_module

    text = "ab " * 2000 + "café 😀 " * 1000
    assert len(text) > tokenizer_module._GIL_HELD_CHARS
    assert ours.encode(text) == list(ours.backend.encode(text).ids)
    assert ours.encode(text, False) == list(ours.backend.encode(text, add_special_tokens=False).ids)
    ids = ours.encode(text)
    assert len(ids) > tokenizer_module._GIL_HELD_CHARS  # decode's threshold is in ids
    for skip in (True, False):
        assert ours.decode(ids, skip) == ours.backend.decode(ids, skip_special_tokens=skip)
    big = "ab " * 300_000  # a few hundred ms of tokenizing
    gaps: list[float] = []
    done = threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    t = threading.Thread(target=tick)
    t.start()
    start = time.perf_counter()
    ours.encode(big)
    took = time.perf_counter() - start
    done.set()
    t.join()
    # A ratio within one run, not a time: with the GIL held, the other thread's longest wait is the
    # whole encode (0.93-0.95 of it measured), without it a few of its ticks.
    assert max(gaps) < 0.75 * took, (max(gaps), took)


def test_max_token_chars_bounds_the_token_count_of_byte_level_bpe(ours):
    """SmolLM2 (byte-level BPE, no normalizer): no token stands for more characters than
    ``max_token_chars``, so a text has at least ``len / max_token_chars`` tokens; other tokenizers have no
    such bound (None)."""
    from tokenizers import AddedToken, models, normalizers
    from tokenizers import Tokenizer as Backend

    longest = ours.max_token_chars
    assert longest is not None and 16 <= longest <= 256
    texts = TEXTS + [" " * 5000, "\n" * 3000, "-" * 4000, "=" * 999, "0" * 777, "ab " * 3000, "😀" * 500]
    for text in texts:
        assert len(ours.encode(text, add_special_tokens=False)) >= -(-len(text) // longest), text[:20]
    word_level = Backend(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    bpe = Backend(models.BPE())
    bpe.normalizer = normalizers.NFC()
    stripping = Backend.from_str(ours.backend.to_str())
    stripping.add_special_tokens([AddedToken("<mask>", lstrip=True, rstrip=True)])
    assert len(stripping.encode(" " * 5000 + "<mask>" + " " * 5000).ids) == 1  # 10,006 characters
    for backend in (word_level, bpe, stripping):
        assert Tokenizer(backend, special_tokens={}).max_token_chars is None
