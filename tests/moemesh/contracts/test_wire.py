import pytest

from moemesh.contracts.info import LoadReport, ModelInfo, ServerInfo
from moemesh.contracts.placement import Placement
from moemesh.contracts.wire import (
    load_from_proto, load_to_proto, model_info_from_proto, model_info_to_proto, placement_from_proto, placement_to_proto,
    server_from_proto, server_to_proto,
)


def test_placement_round_trip():
    p = Placement(3, {1: (("a",), ("a", "b")), 3: (("b",), ("a",))})
    assert placement_from_proto(placement_to_proto(p)) == p


@pytest.mark.parametrize("state", ["serving", "draining", "dead"])
def test_server_round_trip(state):
    s = ServerInfo("expert-1", "10.0.0.2:50051", "cuda:1", 1 << 30, 64, "host-a", "10.0.0.2:29500", state)
    assert server_from_proto(server_to_proto(s)) == s


def test_load_round_trip():
    load = LoadReport(waiting=2, running=5, free_blocks=10, total_blocks=64, serving=False, accepted=9)
    assert load_from_proto(load_to_proto(load)) == load
    assert load.sequences == 7


def test_model_info_round_trip_leaves_the_routers_fields_out():
    info = ModelInfo("MixtralForCausalLM", 512, 64, 63, (2,), 8, 2, 4, "/models/tiny", 3, name="tiny", has_chat_template=True)
    back = model_info_from_proto(model_info_to_proto(info))
    assert back == ModelInfo("MixtralForCausalLM", 512, 64, 63, (2,), 8, 2, 4, "/models/tiny", 3)
