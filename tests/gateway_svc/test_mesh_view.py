"""The chat page's mesh JSON from a control plane status (heat map rows per MoE layer)."""
from gateway_svc.mesh_view import control_pb2, status_json
from moemesh.rpc.protos import load

expert_pb2, _ = load("expert")


def test_status_json_builds_the_heat_map_and_tables():
    st = control_pb2.StatusResponse(placement_version=4, balancedness=0.5, window_tokens=30)
    for layer in (1, 3):
        lp = st.placement.layers.add(layer=layer)
        for e in range(3):
            lp.experts.add(server_ids=["expert-0" if e < 2 else "expert-1"])
    st.expert_loads.extend([expert_pb2.ExpertLoad(layer=3, expert_id=2, tokens=20), expert_pb2.ExpertLoad(layer=1, expert_id=0, tokens=10),
                            expert_pb2.ExpertLoad(layer=9, expert_id=0, tokens=5)])
    s = st.servers.add(experts_held=4, window_tokens=10, queue_depth=1)
    s.server.server_id, s.server.state, s.server.device = "expert-0", control_pb2.SERVER_STATE_DRAINING, "cuda:0"
    s.gpu.available, s.gpu.utilization = True, 0.25
    st.replicas.add(replica_id="attention-0", address="a:1", adopted_version=4, alive=True)
    st.knobs.top_k = 2
    j = status_json(st)
    assert j["layers"] == [1, 3] and j["num_experts"] == 3
    assert j["load"] == [[10, 0, 0], [0, 0, 20]]  # a load for a layer outside the placement is left out
    assert j["placement"][1] == [["expert-0"], ["expert-0"], ["expert-1"]]
    assert j["servers"][0]["state"] == "draining" and j["servers"][0]["gpu"]["utilization"] == 0.25
    assert j["replicas"] == [{"id": "attention-0", "address": "a:1", "adopted_version": 4, "alive": True}]
    assert j["knobs"] == {"top_k": 2, "capacity_factor": None} and j["placement_version"] == 4
