"""Reasoning and tool-call splitting: the same events whichever way the text is cut into deltas."""
from __future__ import annotations

import random

import pytest

from gateway_svc.parsing import Content, OutputParser, Reasoning, ReasoningSplitter, ToolCall, ToolCallSplitter, parse_tool_call
from gateway_svc.parsing.held import partial_marker


def cuts(text: str, seed: int) -> list[str]:
    """`text` cut at random places (every cut place a marker could be split at included over the seeds)."""
    rng = random.Random(seed)
    places = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 12)))) if len(text) > 1 else []
    bounds = [0, *places, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def run_parser(parser, pieces) -> list:
    out = []
    for p in pieces:
        out += parser.feed(p)
    out += parser.flush()
    return merged(out)


def merged(events: list) -> list:
    out = []
    for e in events:
        if isinstance(e, tuple):
            e = Reasoning(e[1]) if e[0] == "reasoning" else Content(e[1])
        if isinstance(e, (Reasoning, Content)) and out and type(out[-1]) is type(e):
            out[-1] = type(e)(out[-1].text + e.text)
        elif isinstance(e, str):
            if out and isinstance(out[-1], Content):
                out[-1] = Content(out[-1].text + e)
            else:
                out.append(Content(e))
        else:
            out.append(e)
    return out


def every_split(text: str):
    """The whole text at once, one character at a time, every two-piece cut, and random cuts."""
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    for seed in range(20):
        yield cuts(text, seed)


def test_partial_marker():
    assert partial_marker("abc<too", "<tool_call>") == 4
    assert partial_marker("abc", "<tool_call>") == 0
    assert partial_marker("<tool_call>", "<tool_call>") == 0  # a whole marker is not partial
    assert partial_marker("<", "</think>") == 1


REASONING_CASES = [
    ("<think>\nLet me see.\n</think>\n\nParis.", [Reasoning("Let me see."), Content("Paris.")]),
    ("  <think>a<b</think>c", [Reasoning("a<b"), Content("c")]),
    ("No thinking here <think>x</think>", [Content("No thinking here <think>x</think>")]),
    ("<think>\nstill thinking when cut off", [Reasoning("still thinking when cut off")]),
    ("<think></think>\n\nOnly an answer", [Content("Only an answer")]),
    ("<thin", [Content("<thin")]),
    ("", []),
    ("\n\nplain", [Content("\n\nplain")]),
    ("<think>one\n\ntwo</think>three\n", [Reasoning("one\n\ntwo"), Content("three\n")]),
]


@pytest.mark.parametrize("text,expected", REASONING_CASES)
def test_reasoning_split_whatever_the_deltas(text, expected):
    for pieces in every_split(text):
        assert run_parser(ReasoningSplitter(), pieces) == expected, pieces


def test_reasoning_streams_before_the_end_tag():
    s = ReasoningSplitter()
    assert s.feed("<think>abc") == [("reasoning", "abc")]
    assert s.feed("def</th") == [("reasoning", "def")]  # "</th" held: it may begin </think>
    assert s.feed("ink>\n\nx") == [("content", "x")]


def test_parse_tool_call_forms():
    assert parse_tool_call('{"name": "f", "arguments": {"a": 1}}') == ToolCall("f", '{"a": 1}')
    assert parse_tool_call(' {"name": "f", "parameters": {"b": "é"}} ') == ToolCall("f", '{"b": "é"}')
    assert parse_tool_call('{"name": "f", "arguments": "{\\"a\\": 2}"}') == ToolCall("f", '{"a": 2}')
    assert parse_tool_call('{"name": "f"}') == ToolCall("f", "{}")
    for bad in ('{"name": 3}', '{"arguments": {}}', "[1]", "not json", '{"name": "f", "arguments": [1]}',
                '{"name": "f", "arguments": "nope"}', '{"name": ""}'):
        assert parse_tool_call(bad) is None, bad


TOOL_CASES = [
    ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     [Content("Checking.\n"), ToolCall("get_weather", '{"city": "Paris"}')]),
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {"x": [1, 2]}}</tool_call>\n',
     [ToolCall("a", "{}"), ToolCall("b", '{"x": [1, 2]}')]),
    ("<tool_call>not json</tool_call> rest", [Content("<tool_call>not json</tool_call> rest")]),
    ('<tool_call>{"name": "cut", "arguments": {"q": 1}}', [ToolCall("cut", '{"q": 1}')]),
    ('<tool_call>{"name": "cut", "argu', [Content('<tool_call>{"name": "cut", "argu')]),
    ("a < b and <tool", [Content("a < b and <tool")]),
    ('<tool_call>{"name": "a"}</tool_call> then text', [ToolCall("a", "{}"), Content(" then text")]),
]


@pytest.mark.parametrize("text,expected", TOOL_CASES)
def test_tool_calls_whatever_the_deltas(text, expected):
    for pieces in every_split(text):
        assert run_parser(ToolCallSplitter(), pieces) == expected, pieces


def test_tool_call_text_before_the_block_is_not_held():
    s = ToolCallSplitter()
    assert s.feed("Hello <to") == ["Hello "]
    assert s.feed("ol_call>{") == []
    assert s.feed('"name": "f"}</tool_call>') == [ToolCall("f", "{}")]
    assert s.calls == 1


def test_output_parser_reasoning_then_tool_calls_across_deltas():
    text = '<think>\nneed weather\n</think>\n\n<tool_call>\n{"name": "w", "arguments": {"c": "P"}}\n</tool_call>'
    expected = [Reasoning("need weather"), ToolCall("w", '{"c": "P"}')]
    for pieces in every_split(text):
        p = OutputParser(reasoning=True, tools=True)
        assert run_parser(p, pieces) == expected, pieces
        assert p.tool_calls == 1


def test_output_parser_without_tools_leaves_tool_call_text_alone():
    text = '<tool_call>{"name": "w"}</tool_call>'
    assert run_parser(OutputParser(reasoning=True, tools=False), [text]) == [Content(text)]


def test_output_parser_without_reasoning_leaves_think_text_alone():
    assert run_parser(OutputParser(reasoning=False), ["<think>x</think>y"]) == [Content("<think>x</think>y")]
