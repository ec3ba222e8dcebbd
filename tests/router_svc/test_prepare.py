import pytest

from moemesh.errors import MeshError
from router_svc.prepare import RequestPreparer
from router_svc.types import ChatTurn, GenerationInput, SamplingSpec


def rejects(prep, code, field, **kw):
    with pytest.raises(MeshError) as e:
        prep.prepare(GenerationInput(**kw))
    assert e.value.code.name == code
    assert e.value.message.startswith(field), e.value.message


def test_text_prompt_is_tokenized(info, tokenizer):
    spec = RequestPreparer(info, tokenizer).prepare(GenerationInput(request_id="r", prompt="Hello world"))
    assert spec.request_id == "r"
    assert tokenizer.decode(spec.prompt_token_ids) == "Hello world"


def test_chat_messages_use_the_template(info, tokenizer):
    spec = RequestPreparer(info, tokenizer).prepare(GenerationInput(messages=(ChatTurn("user", "Hi"),)))
    assert tokenizer.decode(spec.prompt_token_ids, skip_special_tokens=False) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert spec.request_id  # one is made up when the client sent none


def test_token_ids_pass_through(info):
    spec = RequestPreparer(info).prepare(GenerationInput(prompt_token_ids=(5, 6, 7)))
    assert spec.prompt_token_ids == (5, 6, 7)


@pytest.mark.parametrize(
    "code, field, kw",
    [
        ("INVALID_ARGUMENT", "prompt", {}),
        ("INVALID_ARGUMENT", "prompt", {"prompt": ""}),
        ("INVALID_ARGUMENT", "prompt_token_ids", {"prompt_token_ids": ()}),
        ("INVALID_ARGUMENT", "prompt_token_ids[1]", {"prompt_token_ids": (1, 512)}),
        ("INVALID_ARGUMENT", "prompt_token_ids[0]", {"prompt_token_ids": (-1,)}),
        ("OUT_OF_RANGE", "prompt_token_ids", {"prompt_token_ids": (5,) * 64}),
        ("INVALID_ARGUMENT", "messages", {"messages": ()}),
        ("INVALID_ARGUMENT", "messages[0].role", {"messages": (ChatTurn("", "x"),)}),
        ("NOT_FOUND", "model", {"model": "other", "prompt_token_ids": (1,)}),
        ("INVALID_ARGUMENT", "max_new_tokens", {"prompt_token_ids": (1,), "sampling": SamplingSpec(max_new_tokens=0)}),
        ("OUT_OF_RANGE", "max_new_tokens", {"prompt_token_ids": (1,), "sampling": SamplingSpec(max_new_tokens=33)}),
        ("INVALID_ARGUMENT", "temperature", {"prompt_token_ids": (1,), "sampling": SamplingSpec(temperature=-0.5)}),
        ("INVALID_ARGUMENT", "temperature", {"prompt_token_ids": (1,), "sampling": SamplingSpec(temperature=float("nan"))}),
        ("INVALID_ARGUMENT", "top_p", {"prompt_token_ids": (1,), "sampling": SamplingSpec(top_p=0.0)}),
        ("INVALID_ARGUMENT", "top_p", {"prompt_token_ids": (1,), "sampling": SamplingSpec(top_p=1.5)}),
        ("INVALID_ARGUMENT", "top_k", {"prompt_token_ids": (1,), "sampling": SamplingSpec(top_k=-2)}),
        ("INVALID_ARGUMENT", "stop_token_ids[0]", {"prompt_token_ids": (1,), "sampling": SamplingSpec(stop_token_ids=(9999,))}),
        ("INVALID_ARGUMENT", "stop[1]", {"prompt_token_ids": (1,), "stop": ("a", "")}),
        ("INVALID_ARGUMENT", "request_id", {"request_id": "x" * 300, "prompt_token_ids": (1,)}),
    ],
)
def test_bad_input_names_the_field(info, tokenizer, code, field, kw):
    rejects(RequestPreparer(info, tokenizer), code, field, **kw)


def test_text_needs_a_tokenizer(info):
    rejects(RequestPreparer(info, None), "FAILED_PRECONDITION", "prompt", prompt="hi")


def test_long_text_prompt_is_out_of_range(info, tokenizer):
    rejects(RequestPreparer(info, tokenizer), "OUT_OF_RANGE", "prompt", prompt="The quick brown fox. " * 40)


def test_prompt_plus_max_new_tokens_beyond_context_is_out_of_range(info):
    rejects(RequestPreparer(info), "OUT_OF_RANGE", "max_new_tokens",
            prompt_token_ids=(5,) * 40, sampling=SamplingSpec(max_new_tokens=30))


def test_tokenizer_eos_stops_generation_unless_ignored(info, tokenizer):
    prep = RequestPreparer(info, tokenizer)
    spec = prep.prepare(GenerationInput(prompt_token_ids=(5,), sampling=SamplingSpec(stop_token_ids=(7,))))
    assert spec.sampling.stop_token_ids == (7, *tokenizer.eos_token_ids)
    spec = prep.prepare(GenerationInput(prompt_token_ids=(5,), sampling=SamplingSpec(ignore_eos=True)))
    assert spec.sampling.stop_token_ids == ()
