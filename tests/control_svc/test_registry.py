import pytest

from control_svc.registry import Registry
from moemesh.contracts.info import ServerInfo
from moemesh.errors import MeshError


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_register_heartbeat_drain_deregister():
    clock = Clock()
    reg = Registry(clock=clock)
    a = reg.register_expert(ServerInfo("", "127.0.0.1:1", slot_budget=4))
    b = reg.register_expert(ServerInfo("ignored", "127.0.0.1:2"))
    assert (a.server_id, b.server_id) == ("expert-0", "expert-1") and a.state == "serving"
    assert reg.heartbeat("expert-0") and not reg.heartbeat("expert-9")
    assert reg.drain("expert-1") == "draining"
    assert [s.server_id for s in reg.serving()] == ["expert-0"]
    reg.deregister("expert-1")
    with pytest.raises(MeshError, match="not (a )?registered"):
        reg.deregister("expert-1")
    with pytest.raises(MeshError, match="not (a )?registered"):
        reg.drain("nope")


def test_silent_servers_and_replicas_die_and_must_reregister():
    clock = Clock()
    reg = Registry(clock=clock)
    reg.register_expert(ServerInfo("", "127.0.0.1:1"))
    reg.register_expert(ServerInfo("", "127.0.0.1:2"))
    rid = reg.register_attention("127.0.0.1:3")
    clock.t = 3.0
    assert reg.heartbeat("expert-1") and reg.heartbeat(rid, adopted_version=2)
    clock.t = 6.0
    assert reg.reap(dead_after_s=5.0) == ["expert-0"]
    assert not reg.heartbeat("expert-0")
    assert [r.adopted_version for r in reg.live_attention()] == [2]
    clock.t = 20.0
    reg.reap(dead_after_s=5.0)
    assert reg.live_attention() == [] and not reg.heartbeat(rid)
    again = reg.register_expert(ServerInfo("", "127.0.0.1:1"))  # same address: replaces the dead record
    assert again.server_id == "expert-2" and "expert-0" not in reg.experts


def test_bad_address_is_refused():
    with pytest.raises(MeshError, match="server.address"):
        Registry().register_expert(ServerInfo("", "nowhere"))
