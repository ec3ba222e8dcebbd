"""Proto <-> domain translation of the Generation servicer (no server needed)."""
import pytest

import grpc

from moemesh.errors import MeshError
from router_svc.client import Completion, build_request
from router_svc.servicer import parse_request, to_input, to_response
from router_svc.types import Delta, Finished


def test_unset_sampling_fields_stay_unset_and_zero_temperature_is_kept():
    inp = to_input(build_request(prompt="hi", temperature=0.0))
    assert inp.sampling.temperature == 0.0
    assert inp.sampling.max_new_tokens is None and inp.sampling.top_p is None and inp.sampling.seed is None
    assert inp.prompt == "hi" and inp.prompt_token_ids is None and inp.messages is None
    assert inp.request_id  # made up when the client sent none


def test_each_input_kind_translates():
    assert to_input(build_request(prompt_token_ids=[1, 2])).prompt_token_ids == (1, 2)
    msgs = to_input(build_request(messages=[("system", "be brief"), ("user", "hi")])).messages
    assert [(m.role, m.content) for m in msgs] == [("system", "be brief"), ("user", "hi")]
    assert to_input(build_request(prompt="x", stop=["a", "b"], request_id="r")).stop == ("a", "b")


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
