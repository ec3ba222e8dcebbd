"""The gateway in front of a live mesh on the demo model (`moemesh up --http-port`), through the
official OpenAI and Anthropic SDKs, raw HTTP, and a real browser on the chat page."""
from __future__ import annotations

import os
import shutil
import socket
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from moemesh.launcher.mesh import Mesh, MeshSpec
from tests.fixtures.services import attention_load, wait_idle
from tests.gateway_svc import browser

pytestmark = pytest.mark.slow  # a mesh of service processes on the demo model, and a browser

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    from moemesh.demo_model import ensure_demo_model

    spec = MeshSpec(model_dir=str(ensure_demo_model()), expert_servers=2, http_port=0, start_timeout_s=600, grace_s=5)
    m = Mesh(spec, tmp_path_factory.mktemp("gateway-mesh-logs"))
    m.start()
    yield m
    m.stop()


@pytest.fixture(scope="module")
def served(mesh):
    return httpx.get(f"http://{mesh.http_addr}/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def oai(mesh):
    return openai.OpenAI(base_url=f"http://{mesh.http_addr}/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def claude(mesh):
    return anthropic.Anthropic(base_url=f"http://{mesh.http_addr}", api_key="none", max_retries=0, timeout=300)


def test_health_and_model(mesh, served):
    assert httpx.get(f"http://{mesh.http_addr}/health").status_code == 200
    assert served == "demo-smollm2-moe"


def test_chat_create_and_stream_give_the_same_greedy_answer(oai, served):
    r = oai.chat.completions.create(model=served, messages=QUESTION, temperature=0, max_tokens=24)
    text = r.choices[0].message.content
    assert "Paris" in text and r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens > 10 and 1 <= r.usage.completion_tokens <= 24
    chunks = list(oai.chat.completions.create(model=served, messages=QUESTION, temperature=0, max_tokens=24, stream=True,
                                              stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again: its prefix is cached


def test_stop_strings_and_length(oai, claude, served):
    r = oai.chat.completions.create(model=served, messages=QUESTION, temperature=0, max_tokens=24, stop=["Paris"])
    assert "Paris" not in r.choices[0].message.content and r.choices[0].finish_reason == "stop"
    r = oai.chat.completions.create(model=served, messages=QUESTION, temperature=0, max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    greedy = {"temperature": 0}
    m = claude.messages.create(model=served, max_tokens=24, messages=QUESTION, stop_sequences=["Paris"], extra_body=greedy)
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "Paris")
    m = claude.messages.create(model=served, max_tokens=2, messages=QUESTION, extra_body=greedy)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 2


def test_seeded_sampling_repeats(oai, served):
    answers = {oai.chat.completions.create(model=served, messages=QUESTION, temperature=1.0, seed=11, max_tokens=8).choices[0].message.content
               for _ in range(2)}
    assert len(answers) == 1


def test_completions_with_logprobs(oai, served):
    r = oai.completions.create(model=served, prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 == r.usage.completion_tokens and "".join(lp.tokens) == r.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and chosen <= 0
        assert chosen == pytest.approx(max(top.values()), abs=1e-6)  # greedy: the chosen token is the most likely


def test_anthropic_create_stream_and_count_tokens(claude, served):
    m = claude.messages.create(model=served, max_tokens=24, messages=QUESTION, extra_body={"temperature": 0})
    assert m.content[0].type == "text" and "Paris" in m.content[0].text and m.stop_reason == "end_turn"
    with claude.messages.stream(model=served, max_tokens=24, messages=QUESTION, extra_body={"temperature": 0}) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == m.content[0].text == final.content[0].text
    counted = claude.messages.count_tokens(model=served, messages=QUESTION).input_tokens
    # the same prompt again: Anthropic counts the prompt tokens served from the prefix cache apart
    assert final.usage.cache_read_input_tokens > 0
    assert counted == final.usage.input_tokens + final.usage.cache_read_input_tokens


def test_errors_from_the_mesh(oai, claude, served):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=served, messages=QUESTION, max_tokens=10**7)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gpt-4o", messages=QUESTION)
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=served, max_tokens=10**7, messages=QUESTION)
    assert err.value.body["error"]["message"].startswith("max_tokens:")


def test_a_client_that_goes_away_frees_its_kv_blocks(mesh, served):
    attention = mesh.addresses["attention-0"]
    body = (b'{"model": "%s", "messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": 4000, '
            b'"ignore_eos": true, "stream": true}' % served.encode())
    s = socket.create_connection(tuple(mesh.http_addr.rsplit(":", 1)[0:1]) + (int(mesh.http_addr.rsplit(":", 1)[1]),), timeout=60)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    got = b""
    while got.count(b"data: ") < 4:
        got += s.recv(65536)
    load = attention_load(attention, mesh.rpc)
    assert load.running == 1 and load.free_blocks < load.total_blocks
    s.close()
    t0 = time.monotonic()
    load = wait_idle(attention, timeout_s=30, rpc=mesh.rpc)
    assert (load.running, load.waiting, load.free_blocks) == (0, 0, load.total_blocks)
    assert time.monotonic() - t0 < 30  # 4000 tokens would take minutes here: the sequence was aborted


def test_mesh_view(mesh):
    view = httpx.get(f"http://{mesh.http_addr}/api/mesh").json()
    assert view["available"] and view["placement_version"] >= 1 and len(view["servers"]) == 2
    assert view["num_experts"] == 8 and len(view["layers"]) == 30 and len(view["load"]) == 30
    assert all(len(row) == 8 for row in view["load"]) and all(len(row) == 8 for row in view["placement"])
    assert view["replicas"] and view["replicas"][0]["alive"]


@pytest.mark.skipif(not browser.available(), reason="Debian's chromium is not installed (scripts/setup.sh installs it with the test extras)")
def test_chat_page_in_a_browser(mesh, tmp_path):
    with browser.browser_page(tmp_path / "profile", height=1250) as page:
        page.goto(f"http://{mesh.http_addr}/")
        page.wait_for_function("document.getElementById('mesh-version').textContent.startsWith('v')", timeout=30000)
        assert page.get_attribute("#heatmap", "data-cells") == str(30 * 8)
        assert page.locator("#servers tr").count() == 2
        page.fill("#temperature", "0")
        page.fill("#max_tokens", "24")
        page.fill("#prompt", "What is the capital of France?")
        page.press("#prompt", "Enter")
        page.wait_for_function("(document.querySelector('.msg.assistant .meta') || {}).textContent?.includes('finish')", timeout=120000)
        assert "Paris" in page.inner_text(".msg.assistant .text")
        assert float(page.inner_text("#tps")) > 0 and int(page.inner_text("#ntok")) > 1
        assert "finish: stop" in page.inner_text(".msg.assistant .meta")
        shot = tmp_path / "chat-page.png"
        page.screenshot(path=str(shot))
    assert shot.stat().st_size > 10_000
    if os.environ.get("MOEMESH_UPDATE_SCREENSHOTS"):
        shutil.copy(shot, DOCS / "chat-page.png")
