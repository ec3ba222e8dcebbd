"""What the router renders for the HTTP gateway: tools, tool calls and tool results through the chat
template, template kwargs, a continued final message, token counts, filling the context, and the
extra response fields (usage on the first delta, token texts, top logprobs, the stop string)."""
from __future__ import annotations

import json

import grpc
import pytest

from moemesh.contracts.info import ModelInfo
from moemesh.errors import MeshError
from router_svc.output import OutputAssembler
from router_svc.prepare import RequestPreparer
from router_svc.types import ChatTurn, GenerationInput, SamplingSpec, SequenceUpdate, ToolCallSpec, ToolSpec
from tests.fixtures.tokenizers import make_tiny_tokenizer

# A Hermes/Qwen-style template: tools in the system turn, tool calls as <tool_call> JSON, tool results
# in <tool_response>, reasoning kept, and a `think` switch.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response id={{ m.tool_call_id }}>{{ m.content }}</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from moemesh.tokenizer import Tokenizer

    path = make_tiny_tokenizer(tmp_path_factory.mktemp("tools-tok"))
    (path / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    return Tokenizer.from_model_dir(path)


@pytest.fixture
def prep(tok):
    info = ModelInfo(name="tiny", architecture="MixtralForCausalLM", vocab_size=512, max_context=4096,
                     max_new_tokens_limit=1000, eos_token_ids=(2,), has_chat_template=True)
    return RequestPreparer(info, tok)


def rendered(prep, tok, **kw) -> str:
    return tok.decode(prep.prepare(GenerationInput(**kw)).prompt_token_ids, skip_special_tokens=False)


WEATHER = ToolSpec("get_weather", "Weather of a city", json.dumps({"type": "object", "properties": {"city": {"type": "string"}}}))


def test_tools_reach_the_template_as_function_tools(prep, tok):
    text = rendered(prep, tok, messages=(ChatTurn("user", "Hi"),), tools=(WEATHER, ToolSpec("now")))
    assert ('Tools: {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", '
            '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}') in text
    assert '{"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}' in text


def test_tool_calls_and_results_are_rendered_back(prep, tok):
    text = rendered(prep, tok, tools=(WEATHER,), messages=(
        ChatTurn("user", "Weather?"),
        ChatTurn("assistant", "", tool_calls=(ToolCallSpec("call_1", "get_weather", '{"city": "Paris"}'),), reasoning_content="Use it."),
        ChatTurn("tool", "18 C", tool_call_id="call_1"),
    ))
    assert '<|im_start|>assistant\n<think>Use it.</think><tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>' in text
    assert "<tool_response id=call_1>18 C</tool_response>" in text


def test_template_kwargs_are_json_values(prep, tok):
    off = rendered(prep, tok, messages=(ChatTurn("user", "Hi"),), chat_template_kwargs=(("enable_thinking", "false"),))
    on = rendered(prep, tok, messages=(ChatTurn("user", "Hi"),), chat_template_kwargs=(("enable_thinking", "true"),))
    assert off.endswith("<|im_start|>assistant\n<think></think>") and on.endswith("<|im_start|>assistant\n")


def test_continue_final_message(prep, tok):
    text = rendered(prep, tok, messages=(ChatTurn("user", "Capital?"), ChatTurn("assistant", "The capital is")), continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nThe capital is")


@pytest.mark.parametrize("field,kw", [
    ("messages[1].tool_calls[0].arguments", {"messages": (ChatTurn("user", "x"), ChatTurn("assistant", "", tool_calls=(ToolCallSpec("i", "f", "[1]"),)))}),
    ("messages[1].tool_calls[0].arguments", {"messages": (ChatTurn("user", "x"), ChatTurn("assistant", "", tool_calls=(ToolCallSpec("i", "f", "{"),)))}),
    ("messages[1].tool_calls[0].name", {"messages": (ChatTurn("user", "x"), ChatTurn("assistant", "", tool_calls=(ToolCallSpec("i", "", "{}"),)))}),
    ("tools[0].parameters", {"messages": (ChatTurn("user", "x"),), "tools": (ToolSpec("f", "", "nope"),)}),
    ("tools[0].name", {"messages": (ChatTurn("user", "x"),), "tools": (ToolSpec(""),)}),
    ("tools", {"prompt": "x", "tools": (WEATHER,)}),
    ("chat_template_kwargs", {"prompt": "x", "chat_template_kwargs": (("a", "1"),)}),
    ("chat_template_kwargs[x]", {"messages": (ChatTurn("user", "x"),), "chat_template_kwargs": (("x", "not json"),)}),
    ("chat_template_kwargs[messages]", {"messages": (ChatTurn("user", "x"),), "chat_template_kwargs": (("messages", "[]"),)}),
    ("chat_template_kwargs", {"messages": (ChatTurn("user", "x"),), "chat_template_kwargs": (("a-b", "1"),)}),
    ("continue_final_message", {"messages": (ChatTurn("user", "x"),), "continue_final_message": True}),
    ("top_logprobs", {"prompt": "x", "sampling": SamplingSpec(top_logprobs=21)}),
])
def test_bad_chat_input_names_the_field(prep, field, kw):
    with pytest.raises(MeshError) as e:
        prep.prepare(GenerationInput(**kw))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.message.startswith(field + ":"), e.value.message


def test_count_matches_prepare_and_ignores_the_context_limit(prep, tok):
    inp = GenerationInput(messages=(ChatTurn("user", "Hello there"),), tools=(WEATHER,))
    assert prep.count(inp) == len(prep.prepare(inp).prompt_token_ids)
    small = RequestPreparer(ModelInfo(name="tiny", architecture="MixtralForCausalLM", vocab_size=512, max_context=8, max_new_tokens_limit=4,
                                     eos_token_ids=(2,), has_chat_template=True), tok)
    assert small.count(inp) > 8  # counted, though prepare would refuse it


def test_fill_context_sets_the_room_left(prep):
    spec = prep.prepare(GenerationInput(prompt_token_ids=(5,) * 100, fill_context=True))
    assert spec.sampling.max_new_tokens == 1000  # the limit, below the 3996 left in the context
    spec = prep.prepare(GenerationInput(prompt_token_ids=(5,) * 3500, fill_context=True))
    assert spec.sampling.max_new_tokens == 4096 - 3500
    spec = prep.prepare(GenerationInput(prompt_token_ids=(5,) * 10, fill_context=True, sampling=SamplingSpec(max_new_tokens=3)))
    assert spec.sampling.max_new_tokens == 3


def test_deltas_carry_usage_first_token_texts_top_logprobs_and_the_stop(tok):
    prompt = tuple(tok.encode("Hi"))
    ids = tok.encode(" hello world", add_special_tokens=False)
    out = OutputAssembler(prompt, ("world",), tok, token_texts=True)
    first = out.push(SequenceUpdate(token_ids=(ids[0],), logprobs=(-0.1,), top_logprobs=(((ids[0], -0.1), (7, -2.0)),)))
    assert first.prompt_tokens == len(prompt) and first.completion_tokens == 1
    assert first.tokens == (tok.decode([ids[0]], skip_special_tokens=False),)
    assert [(c.token_id, c.logprob) for c in first.top_logprobs[0]] == [(ids[0], -0.1), (7, -2.0)]
    assert first.top_logprobs[0][1].token == tok.decode([7], skip_special_tokens=False)
    rest = [out.push(SequenceUpdate(token_ids=(t,), logprobs=(-0.2,))) for t in ids[1:]]
    assert all(d.prompt_tokens is None for d in rest)
    assert out.stopped and out.finish("stop").stop_string == "world"
    plain = OutputAssembler(prompt, (), tok).push(SequenceUpdate(token_ids=(ids[0],)))
    assert plain.tokens == () and plain.top_logprobs == ()
