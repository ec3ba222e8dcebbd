"""Proto <-> domain translation of the Generation servicer (no server needed)."""
import pytest

import grpc

from moemesh.errors import MeshError
from moemesh.rpc.generation import Completion, build_request
from router_svc.servicer import parse_request, to_input, to_response
from router_svc.types import Delta, Finished, TokenLogprob, ToolCallSpec, ToolSpec


def test_unset_sampling_fields_stay_unset_and_zero_temperature_is_kept():
    inp = to_input(build_request(prompt="hi", temperature=0.0))
    assert inp.sampling.temperature == 0.0
    assert inp.sampling.max_new_tokens is None and inp.sampling.top_p is None and inp.sampling.seed is None
    assert inp.prompt == "hi" and inp.prompt_token_ids is None and inp.messages is None
    assert inp.request_id  # made up when the client sent none


def test_each_input_kind_translates():
    assert list(to_input(build_request(prompt_token_ids=[1, 2])).prompt_token_ids) == [1, 2]
    msgs = to_input(build_request(messages=[("system", "be brief"), ("user", "hi")])).messages
    assert [(m.role, m.content) for m in msgs] == [("system", "be brief"), ("user", "hi")]
    assert list(to_input(build_request(prompt="x", stop=["a", "b"], request_id="r")).stop) == ["a", "b"]


def test_malformed_bytes_are_invalid_argument():
    with pytest.raises(MeshError) as e:
        parse_request(b"\x1a\x05ab")  # length runs past the end
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.message.startswith("request:")


def test_responses_accumulate_into_the_run_json_shape():
    done = Completion()
    done.add(to_response("r", Delta(text="He", token_ids=(7,), logprobs=(-0.5,))))
    done.add(to_response("r", Delta(text="llo", token_ids=(8,), logprobs=(-0.25,))))
    final = to_response("r", Finished("length", prompt_token_ids=(1, 2), completion_tokens=2, prompt_logprobs=(None, -1.5)))
    assert final.usage.prompt_tokens == 2 and final.usage.completion_tokens == 2
    done.add(final)
    assert done.to_json() == {
        "prompt_token_ids": [1, 2], "token_ids": [7, 8], "text": "Hello", "finish_reason": "length",
        "logprobs": [-0.5, -0.25], "prompt_logprobs": [None, -1.5],
    }


def test_prompt_logprobs_absent_unless_asked():
    done = Completion()
    done.add(to_response("r", Finished("stop", prompt_token_ids=(1,), completion_tokens=0)))
    assert done.to_json()["prompt_logprobs"] is None


def test_chat_extras_translate():
    from moemesh.rpc.generation import pb

    req = build_request(messages=[("user", "hi")], top_logprobs=3)
    req.messages.messages.append(pb.ChatMessage(role="assistant", content="", reasoning_content="hm",
                                                tool_calls=[pb.ToolCall(id="c1", name="f", arguments='{"a": 1}')]))
    req.messages.messages.append(pb.ChatMessage(role="tool", content="42", tool_call_id="c1", name="f"))
    req.tools.append(pb.Tool(name="f", description="d", parameters='{"type": "object"}'))
    req.chat_template_kwargs["enable_thinking"] = "false"
    req.fill_context = True
    req.continue_final_message = True
    inp = to_input(req)
    assert inp.sampling.top_logprobs == 3 and inp.fill_context and inp.continue_final_message
    assert inp.messages[1].tool_calls[0] == ToolCallSpec("c1", "f", '{"a": 1}') and inp.messages[1].reasoning_content == "hm"
    assert (inp.messages[2].tool_call_id, inp.messages[2].name) == ("c1", "f")
    assert inp.tools == (ToolSpec("f", "d", '{"type": "object"}'),)
    assert inp.chat_template_kwargs == (("enable_thinking", "false"),)


def test_response_extras_translate():
    delta = Delta(text="a", token_ids=(7,), logprobs=(-0.5,), tokens=("a",),
                  top_logprobs=((TokenLogprob(7, "a", -0.5), TokenLogprob(9, "b", -1.0)),), prompt_tokens=4, completion_tokens=1)
    msg = to_response("r", delta)
    assert (msg.usage.prompt_tokens, msg.usage.completion_tokens, list(msg.tokens)) == (4, 1, ["a"])
    assert [(c.token_id, c.token, c.logprob) for c in msg.top_logprobs[0].candidates] == [(7, "a", -0.5), (9, "b", -1.0)]
    assert not to_response("r", Delta(text="b", token_ids=(8,))).HasField("usage")
    final = to_response("r", Finished("stop", prompt_token_ids=(1,), completion_tokens=2, stop_string="END"))
    assert final.stop_string == "END"
