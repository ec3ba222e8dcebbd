from __future__ import annotations

import json
import shutil

import jinja2
import pytest

from moemesh.tokenizer import Tokenizer
from tests.fixtures.tokenizers import CHATML_TEMPLATE, make_tiny_tokenizer

TEXTS = [
    "Hello world",
    "What is the capital of France?",
    "  leading spaces and trailing  ",
    "Café naïve Zürich",
    "东京是日本的首都 こんにちは 안녕",
    "emoji 😀🎉🚀 👍🏽 🇫🇷",
    "digits 1234567890 and code: def f(x):\n\treturn x",
    "<|im_start|>user\nhi<|im_end|>\n",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "东京?"}],
]


@pytest.fixture(scope="module")
def hf_tok(tiny_tok_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(tiny_tok_dir))


@pytest.fixture(scope="module")
def tok(tiny_tok_dir):
    return Tokenizer.from_model_dir(tiny_tok_dir)


def test_fixture_vocab_fits(tok):
    assert tok.vocab_size == 512
    assert tok.token_to_id("<|im_start|>") == 1 and tok.token_to_id("<|im_end|>") == 2


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tok, hf_tok, text):
    for special in (True, False):
        ids = tok.encode(text, add_special_tokens=special)
        assert ids == hf_tok.encode(text, add_special_tokens=special)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip)


def test_roundtrip_without_specials(tok):
    for text in TEXTS[:-2]:
        assert tok.decode(tok.encode(text)) == text


def test_special_ids(tok, hf_tok):
    assert tok.bos_token_id == hf_tok.bos_token_id == 0
    assert tok.eos_token_ids == [hf_tok.eos_token_id] == [2]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf_tok, messages, add_generation_prompt):
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


def _variant_dir(src, dst, template, in_config):
    shutil.copytree(src, dst)
    (dst / "chat_template.jinja").unlink()
    if in_config:
        cfg = json.loads((dst / "tokenizer_config.json").read_text())
        cfg["chat_template"] = template
        (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


# Block tags on their own lines, loop controls, bos/eos tokens, namespace and tojson: exercises
# trim_blocks/lstrip_blocks and the globals transformers provides.
RICH_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(n=0) %}
{% for message in messages %}
    {% if message['role'] == 'skip' %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
    [{{ ns.n }}] {{ message['role'] }}: {{ message['content'] | tojson }}{{ eos_token }}
    {% if message['role'] == 'stop' %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}
assistant:
{% endif %}"""


def test_template_from_tokenizer_config_matches_transformers(tiny_tok_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    d = _variant_dir(tiny_tok_dir, tmp_path / "m", RICH_TEMPLATE, in_config=True)
    messages = [
        {"role": "user", "content": "a <b> \"c\" 😀"},
        {"role": "skip", "content": "x"},
        {"role": "stop", "content": "y"},
        {"role": "user", "content": "never shown"},
    ]
    ours = Tokenizer.from_model_dir(d).apply_chat_template(messages)
    theirs = transformers.AutoTokenizer.from_pretrained(str(d)).apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert "never shown" not in ours and "[2] stop" in ours and "<b>" in ours


def test_raise_exception_in_template(tiny_tok_dir, tmp_path):
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok"
    d = _variant_dir(tiny_tok_dir, tmp_path / "m", template, in_config=True)
    tok = Tokenizer.from_model_dir(d)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(jinja2.exceptions.TemplateError, match="first must be user"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_no_chat_template(tiny_tok_dir, tmp_path):
    d = _variant_dir(tiny_tok_dir, tmp_path / "m", None, in_config=False)
    tok = Tokenizer.from_model_dir(d)
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    "messages, field",
    [
        ([{"content": "x"}], r"messages\[0\]\.role"),
        ([{"role": "user"}], r"messages\[0\]\.content"),
        ([{"role": "user", "content": "x"}, "hi"], r"messages\[1\]"),
        ("hi", "messages"),
    ],
)
def test_bad_messages(tok, messages, field):
    with pytest.raises(ValueError, match=field):
        tok.apply_chat_template(messages)


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_model_dir(tmp_path)


def test_generation_config_eos_and_add_bos(tmp_path):
    d = make_tiny_tokenizer(tmp_path, add_bos_token=True)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2], "bos_token_id": 0}))
    tok = Tokenizer.from_model_dir(d)
    assert tok.eos_token_ids == [0, 2]
    ids = tok.encode("Hello world")
    assert ids[0] == tok.bos_token_id == 0
    assert ids[1:] == tok.encode("Hello world", add_special_tokens=False)


def test_decode_unknown_and_negative_ids(tok, hf_tok):
    assert tok.decode([370, 512, 365]) == hf_tok.decode([370, 512, 365]) == tok.decode([370, 365])
    with pytest.raises(ValueError, match=">= 0"):
        tok.decode([5, -1])


def test_reasoning_aliases_and_tool_call_messages(tiny_tok_dir, tmp_path):
    template = "{% for m in messages %}{{ m['role'] }}|{{ m['reasoning_content'] }}|{{ m['thinking'] }}|{{ m['content'] }};{% endfor %}"
    d = _variant_dir(tiny_tok_dir, tmp_path / "m", template, in_config=True)
    messages = [{"role": "assistant", "reasoning": "hmm", "content": "ok"}, {"role": "assistant", "content": None, "tool_calls": []}]
    import transformers

    ours = Tokenizer.from_model_dir(d).apply_chat_template(messages)
    theirs = transformers.AutoTokenizer.from_pretrained(str(d)).apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == theirs == "assistant|hmm|hmm|ok;assistant|||;"


def test_add_eos_token(tmp_path):
    d = make_tiny_tokenizer(tmp_path)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["add_eos_token"] = True
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_model_dir(d)
    assert tok.encode("Hello") == tok.encode("Hello", add_special_tokens=False) + [2]
