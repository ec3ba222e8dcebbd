"""The OpenAI API through the official SDK, against a scripted router: what the gateway sends the
router, and how the router's stream comes back (text, reasoning, tool calls, logprobs, usage, errors)."""
from __future__ import annotations

import json

import openai
import pytest

from tests.gateway_svc.fake_router import script, status

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture
def client(gw):
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_create_sends_the_chat_and_sampling_and_returns_text_and_usage(gw, client):
    r = client.chat.completions.create(
        model="fake-model", messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        temperature=0.3, top_p=0.9, seed=7, max_tokens=20, stop=["\n\n"],
    )
    assert r.object == "chat.completion" and r.model == "fake-model"
    assert r.choices[0].message.content == "Hello world"
    assert r.choices[0].finish_reason == "stop"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (7, 2, 9)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    req = gw.fake.requests[-1]
    assert [(m.role, m.content) for m in req.messages.messages] == [("system", "Be brief."), ("user", "Hi")]
    assert (req.temperature, req.top_p, req.seed, req.max_new_tokens, list(req.stop)) == (pytest.approx(0.3), pytest.approx(0.9), 7, 20, ["\n\n"])
    assert req.model == "" and not req.fill_context


def test_without_max_tokens_the_answer_may_fill_the_context(gw, client):
    client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=None)
    req = gw.fake.requests[-1]
    assert not req.HasField("max_new_tokens") and req.fill_context


def test_max_completion_tokens_is_the_length(gw, client):
    client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=5)
    assert gw.fake.requests[-1].max_new_tokens == 5


def test_stream_with_usage(gw, client):
    gw.reset(script("Hel", "lo", " there"))
    chunks = list(client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Hi"}], stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello there"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3 and chunks[-1].usage.prompt_tokens == 7
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_without_usage_has_no_usage_chunk(gw, client):
    chunks = list(client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Hi"}], stream=True))
    assert all(c.choices for c in chunks)


def test_reasoning_is_split_from_the_answer(gw, client):
    gw.reset(script("<think>\nThe user", " greets.</th", "ink>\n\nHi", "!"))
    r = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Hi"}])
    assert r.choices[0].message.content == "Hi!"
    assert r.choices[0].message.model_extra["reasoning_content"] == "The user greets."
    chunks = list(client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Hi"}], stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == "The user greets."
    assert "".join(d.content or "" for d in deltas) == "Hi!"


TOOL_TEXT = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')


def split_text(text: str, n: int) -> list[str]:
    return [text[i:i + n] for i in range(0, len(text), n)]


def test_tool_calls_come_back_as_tool_calls(gw, client):
    gw.reset(script(*split_text(TOOL_TEXT, 7)))
    r = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER])
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.content == "Let me look.\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
    assert all(c.id.startswith("call_") and c.type == "function" for c in msg.tool_calls)
    tool = gw.fake.requests[-1].tools[0]
    assert (tool.name, tool.description, json.loads(tool.parameters)) == ("get_weather", "Weather of a city", WEATHER["function"]["parameters"])


def test_tool_calls_stream_with_markers_split_across_deltas(gw, client):
    gw.reset(script(*split_text(TOOL_TEXT, 3)))
    chunks = list(client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Weather?"}],
                                                 tools=[WEATHER], stream=True))
    calls: dict[int, dict] = {}
    for c in chunks:
        for tc in c.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": "", "id": tc.id})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
    assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Let me look.\n"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_without_tools_tool_call_text_stays_text(gw, client):
    gw.reset(script(TOOL_TEXT))
    r = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Weather?"}])
    assert r.choices[0].message.content == TOOL_TEXT and not r.choices[0].message.tool_calls


def test_tool_choice_none_keeps_tools_out_of_the_prompt(gw, client):
    gw.reset(script(TOOL_TEXT))
    r = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x"}], tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.content == TOOL_TEXT
    assert len(gw.fake.requests[-1].tools) == 0


def test_tool_turns_are_sent_back(gw, client):
    client.chat.completions.create(model="fake-model", tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ])
    m = gw.fake.requests[-1].messages.messages
    assert [x.role for x in m] == ["user", "assistant", "tool"]
    assert (m[1].tool_calls[0].id, m[1].tool_calls[0].name, json.loads(m[1].tool_calls[0].arguments)) == ("call_1", "get_weather", {"city": "Paris"})
    assert (m[2].tool_call_id, m[2].content) == ("call_1", "18 C, sunny")


def test_reasoning_effort_and_template_kwargs_reach_the_template(gw, client):
    client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x"}], reasoning_effort="high",
                                   extra_body={"chat_template_kwargs": {"enable_thinking": False, "depth": {"n": 2}}})
    kw = dict(gw.fake.requests[-1].chat_template_kwargs)
    assert {k: json.loads(v) for k, v in kw.items()} == {"enable_thinking": False, "depth": {"n": 2}, "reasoning_effort": "high"}


def test_logprobs_and_top_logprobs(gw, client):
    gw.reset(script("Hi", " you", logprobs=True))
    r = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=2)
    req = gw.fake.requests[-1]
    assert req.logprobs and req.top_logprobs == 2
    content = r.choices[0].logprobs.content
    assert [(c.token, c.logprob) for c in content] == [("Hi", -0.25), (" you", -0.5)]
    assert [(t.token, t.logprob) for t in content[0].top_logprobs] == [("Hi", -0.25), ("x", -3.0)]
    assert content[1].bytes == list(b" you")
    chunks = list(client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x"}], logprobs=True,
                                                 top_logprobs=2, stream=True))
    streamed = [e.token for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == ["Hi", " you"]


@pytest.mark.parametrize("code,message,error,http,param", [
    ("INVALID_ARGUMENT", "temperature: must be a finite number >= 0", openai.BadRequestError, 400, "temperature"),
    ("OUT_OF_RANGE", "max_new_tokens: 5000 is beyond the limit of 2047", openai.BadRequestError, 400, "max_tokens"),
    ("NOT_FOUND", "model: unknown model 'x'", openai.NotFoundError, 404, "model"),
    ("RESOURCE_EXHAUSTED", "request: the router is full (1 running, 0 queued); retry later", openai.RateLimitError, 429, None),
    ("UNAVAILABLE", "attention: no attention replica is available; retry later", openai.InternalServerError, 503, None),
    ("DEADLINE_EXCEEDED", "Deadline Exceeded", openai.InternalServerError, 504, None),
])
def test_router_errors_map_to_http_statuses(gw, client, code, message, error, http, param):
    gw.reset(error=status(code, message))
    with pytest.raises(error) as info:
        client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x"}], max_tokens=5000)
    assert info.value.status_code == http
    body = info.value.body
    assert body["param"] == param and body["type"] and message.split(":")[-1].strip() in body["message"]
    with pytest.raises(error):  # streaming too: the error comes before the stream starts
        client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x"}], stream=True)


def test_an_error_mid_stream_arrives_in_the_stream(gw, client):
    gw.reset(script("a", "b", "c"), error=status("UNAVAILABLE", "attention: the replica went away"), fail_after=1)
    stream = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x"}], stream=True)
    with pytest.raises(openai.APIError, match="the replica went away"):
        for _ in stream:
            pass


def test_unknown_model_is_404_before_the_router(gw, client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert info.value.body["code"] == "model_not_found" and "fake-model" in info.value.body["message"]
    assert gw.fake.requests == []


@pytest.mark.parametrize("extra,param", [
    ({"n": 2}, "n"), ({"presence_penalty": 0.5}, "presence_penalty"), ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format.type"), ({"temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"), ({"messages": []}, "messages"),
    ({"top_logprobs": 3}, "top_logprobs"),
])
def test_unsupported_or_malformed_fields_are_400_naming_them(gw, client, extra, param):
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "x"}], **extra}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**{k: v for k, v in body.items() if k in ("model", "messages")},
                                       extra_body={k: v for k, v in body.items() if k not in ("model", "messages")})
    assert info.value.body["param"] == param
    assert gw.fake.requests == []


def test_completions_with_a_prompt_and_logprobs(gw, client):
    gw.reset(script("Par", "is", logprobs=True))
    r = client.completions.create(model="fake-model", prompt="The capital of France is", max_tokens=4, logprobs=2)
    assert r.object == "text_completion" and r.choices[0].text == "Paris" and r.choices[0].finish_reason == "stop"
    lp = r.choices[0].logprobs
    assert lp.tokens == ["Par", "is"] and lp.token_logprobs == [-0.25, -0.5] and lp.text_offset == [0, 3]
    assert lp.top_logprobs[0] == {"Par": -0.25, "x": -3.0}
    req = gw.fake.requests[-1]
    assert (req.prompt, req.max_new_tokens, req.top_logprobs, req.logprobs) == ("The capital of France is", 4, 2, True)


def test_completions_with_token_ids_streamed(gw, client):
    chunks = list(client.completions.create(model="fake-model", prompt=[5, 6, 7], stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hello world"
    assert chunks[-1].usage.completion_tokens == 2
    assert list(gw.fake.requests[-1].prompt_token_ids.ids) == [5, 6, 7]
    assert gw.fake.requests[-1].max_new_tokens == 16  # the completions API's default


def test_completions_refuse_several_prompts(gw, client):
    with pytest.raises(openai.BadRequestError, match="one prompt"):
        client.completions.create(model="fake-model", prompt=["a", "b"])


def test_models(gw, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["fake-model"]
    assert client.models.retrieve("fake-model").id == "fake-model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
