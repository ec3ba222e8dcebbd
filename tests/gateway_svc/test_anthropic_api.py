"""The Anthropic Messages API through the official SDK, against a scripted router: the request sent
to the router, the message and its event stream (text, thinking, tool_use), count_tokens, errors."""
from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from tests.gateway_svc.fake_router import script, status

WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TOOL_TEXT = '<think>Need the weather.</think>\n\nChecking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture
def client(gw):
    return anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0, timeout=30)


def test_create_sends_system_and_sampling_and_returns_a_message(gw, client):
    m = client.messages.create(
        model="fake-model", max_tokens=32, system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": "Hi"}], metadata={"user_id": "u"}, output_config={"effort": "low"},
        extra_body={"temperature": 0.2, "top_p": 0.8, "top_k": 20},
    )
    assert m.type == "message" and m.role == "assistant" and m.model == "fake-model"
    assert [(b.type, b.text) for b in m.content] == [("text", "Hello world")]
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    assert (m.usage.input_tokens, m.usage.output_tokens) == (7, 2)
    req = gw.fake.requests[-1]
    assert [(x.role, x.content) for x in req.messages.messages] == [("system", "Be brief."), ("user", "Hi")]
    assert (req.max_new_tokens, req.top_k) == (32, 20) and req.temperature == pytest.approx(0.2) and req.top_p == pytest.approx(0.8)
    assert json.loads(req.chat_template_kwargs["reasoning_effort"]) == "low"


def test_stop_sequences(gw, client):
    gw.reset(script("Hello", finish="stop", stop_string="END"))
    m = client.messages.create(model="fake-model", max_tokens=8, messages=[{"role": "user", "content": "x"}], stop_sequences=["END", "STOP"])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "END")
    assert list(gw.fake.requests[-1].stop) == ["END", "STOP"]


def test_length_limit_is_max_tokens(gw, client):
    gw.reset(script("a", "b", finish="length"))
    assert client.messages.create(model="fake-model", max_tokens=2, messages=[{"role": "user", "content": "x"}]).stop_reason == "max_tokens"


def test_stream_events_in_order(gw, client):
    gw.reset(script("Hel", "lo"))
    with client.messages.stream(model="fake-model", max_tokens=8, messages=[{"role": "user", "content": "x"}],
                                extra_headers={"anthropic-beta": "prompt-caching-2024-07-31"}) as stream:
        kinds = [e.type for e in stream if e.type in ("message_start", "content_block_start", "content_block_delta",
                                                       "content_block_stop", "message_delta", "message_stop")]
        final = stream.get_final_message()
    assert kinds == ["message_start", "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_stop", "message_delta", "message_stop"]
    assert final.content[0].text == "Hello" and final.stop_reason == "end_turn"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (7, 2)


def test_thinking_and_tool_use_non_streamed(gw, client):
    gw.reset(script(TOOL_TEXT))
    m = client.messages.create(model="fake-model", max_tokens=64, messages=[{"role": "user", "content": "Weather in Paris?"}],
                               tools=[WEATHER], thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"]
    assert m.content[0].thinking == "Need the weather." and m.content[1].text == "Checking."
    tool = m.content[2]
    assert tool.name == "get_weather" and tool.input == {"city": "Paris"} and tool.id.startswith("toolu_")
    assert m.stop_reason == "tool_use"
    req = gw.fake.requests[-1]
    assert json.loads(req.chat_template_kwargs["enable_thinking"]) is True
    assert (req.tools[0].name, json.loads(req.tools[0].parameters)) == ("get_weather", WEATHER["input_schema"])


def test_thinking_and_tool_use_streamed_with_split_markers(gw, client):
    gw.reset(script(*[TOOL_TEXT[i:i + 4] for i in range(0, len(TOOL_TEXT), 4)]))
    with client.messages.stream(model="fake-model", max_tokens=64, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER]) as s:
        deltas = [e.delta.type for e in s if e.type == "content_block_delta"]
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[2].input == {"city": "Paris"} and final.stop_reason == "tool_use"
    assert "input_json_delta" in deltas and "thinking_delta" in deltas and "text_delta" in deltas


def test_tool_results_and_earlier_tool_use_are_rendered_back(gw, client):
    client.messages.create(model="fake-model", max_tokens=16, tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Use the tool.", "signature": "s"},
                                          {"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18 C"}]},
                                     {"type": "text", "text": "And tomorrow?"}]},
    ])
    m = gw.fake.requests[-1].messages.messages
    assert [x.role for x in m] == ["user", "assistant", "tool", "user"]
    assert (m[1].content, m[1].reasoning_content, m[1].tool_calls[0].id, json.loads(m[1].tool_calls[0].arguments)) == (
        "Checking.", "Use the tool.", "toolu_1", {"city": "Paris"})
    assert (m[2].tool_call_id, m[2].content, m[3].content) == ("toolu_1", "18 C", "And tomorrow?")


def test_a_prefilled_answer_is_continued(gw, client):
    client.messages.create(model="fake-model", max_tokens=8, messages=[{"role": "user", "content": "Capital of France?"},
                                                                       {"role": "assistant", "content": "The capital is"}])
    assert gw.fake.requests[-1].continue_final_message


def test_count_tokens(gw, client):
    n = client.messages.count_tokens(model="fake-model", system="ab", messages=[{"role": "user", "content": "hello"}])
    assert n.input_tokens == 7  # the fake counts characters: "ab" + "hello"
    r = httpx.post(gw.url + "/v1/messages/count_tokens?beta=true", json={"model": "fake-model", "messages": [{"role": "user", "content": "xyz"}]},
                   headers={"anthropic-version": "2023-06-01", "anthropic-beta": "token-counting-2024-11-01"})
    assert r.status_code == 200 and r.json() == {"input_tokens": 3}


@pytest.mark.parametrize("code,error,http,kind", [
    ("INVALID_ARGUMENT", anthropic.BadRequestError, 400, "invalid_request_error"),
    ("NOT_FOUND", anthropic.NotFoundError, 404, "not_found_error"),
    ("RESOURCE_EXHAUSTED", anthropic.RateLimitError, 429, "rate_limit_error"),
    ("UNAVAILABLE", anthropic.InternalServerError, 503, "overloaded_error"),
    ("DEADLINE_EXCEEDED", anthropic.InternalServerError, 504, "timeout_error"),
])
def test_router_errors_in_anthropic_shape(gw, client, code, error, http, kind):
    gw.reset(error=status(code, "max_new_tokens: too many"))
    with pytest.raises(error) as info:
        client.messages.create(model="fake-model", max_tokens=8, messages=[{"role": "user", "content": "x"}])
    assert info.value.status_code == http
    assert info.value.body == {"type": "error", "error": {"type": kind, "message": "max_tokens: too many"}}


def test_an_error_mid_stream_is_an_error_event(gw, client):
    gw.reset(script("a", "b", "c"), error=status("UNAVAILABLE", "attention: the replica went away"), fail_after=1)
    with pytest.raises(anthropic.APIStatusError, match="the replica went away"):
        with client.messages.stream(model="fake-model", max_tokens=8, messages=[{"role": "user", "content": "x"}]) as s:
            for _ in s:
                pass


@pytest.mark.parametrize("body,field", [
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "any"}}, "tool_choice.type"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"max_tokens": 8, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"max_tokens": "8", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
])
def test_malformed_requests_are_400_naming_the_field(gw, body, field):
    r = httpx.post(gw.url + "/v1/messages", json={"model": "fake-model", **body}, headers={"anthropic-version": "2023-06-01"})
    assert r.status_code == 400
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["message"].startswith(field + ":")
    assert gw.fake.requests == []


def test_models_in_anthropic_shape(gw, client):
    page = client.models.list()
    assert [m.id for m in page.data] == ["fake-model"] and page.data[0].type == "model"
