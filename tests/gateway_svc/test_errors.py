"""gRPC statuses -> HTTP statuses and the two APIs' error shapes."""
import grpc
import pytest

from gateway_svc.errors import ApiError, from_mesh_error
from moemesh.errors import MeshError


@pytest.mark.parametrize("code,http", [("INVALID_ARGUMENT", 400), ("OUT_OF_RANGE", 400), ("FAILED_PRECONDITION", 400), ("NOT_FOUND", 404),
                                       ("RESOURCE_EXHAUSTED", 429), ("UNAVAILABLE", 503), ("DEADLINE_EXCEEDED", 504), ("INTERNAL", 500),
                                       ("UNKNOWN", 500)])
def test_status_mapping(code, http):
    assert from_mesh_error(MeshError(grpc.StatusCode[code], "x")).status == http


def test_field_is_renamed_and_becomes_param():
    e = from_mesh_error(MeshError(grpc.StatusCode.OUT_OF_RANGE, "max_new_tokens: 5000 is beyond the limit"), {"max_new_tokens": "max_tokens"})
    assert (e.param, e.message) == ("max_tokens", "max_tokens: 5000 is beyond the limit")
    e = from_mesh_error(MeshError(grpc.StatusCode.INVALID_ARGUMENT, "messages[2].tool_calls[0].arguments: not valid JSON"))
    assert e.param == "messages[2].tool_calls[0].arguments"
    e = from_mesh_error(MeshError(grpc.StatusCode.UNAVAILABLE, "attention: no attention replica is available"))
    assert e.param is None and e.message == "attention: no attention replica is available"  # not a request field
    assert from_mesh_error(MeshError(grpc.StatusCode.NOT_FOUND, "model: unknown model 'x'")).code == "model_not_found"


def test_shapes():
    e = ApiError(429, "request: full")
    assert e.openai_body() == {"error": {"message": "request: full", "type": "rate_limit_error", "param": None, "code": None}}
    assert e.anthropic_body() == {"type": "error", "error": {"type": "rate_limit_error", "message": "request: full"}}
    assert ApiError(500, "boom").anthropic_body()["error"]["type"] == "api_error"
    assert ApiError(500, "boom").openai_body()["error"]["type"] == "server_error"
