"""`ControlFollower`: an attention replica's side of the control plane, off the expert call path.

    follower = ControlFollower(control_addr, rpc)
    placement, servers = await follower.first_placement()      # watches placements from here on
    experts = RemoteExperts(placement, servers, transport_for, report_failure=follower.report_failure, ...)
    ... build the engine on `experts` ...
    await follower.start(experts, my_address, apply_knobs, wake)  # register, follow, heartbeat
    follower.begin_step()                                       # between engine steps
    await follower.close()

Every committed placement (WatchPlacement) is staged on `RemoteExperts` and adopted at the next
step boundary together with the routing knobs (top-k, capacity) its version carries, applied to the
engine for all MoE layers at once (`apply_knobs`); `wake` runs the step loop once so an idle replica
adopts it too. The servers an update lists as dead are handed to `RemoteExperts.servers_dead` at
once: calls in flight to them fail over now instead of waiting for their timeout. Heartbeats report
the adopted version, so the control plane releases old copies only after the steps on them finished.

The control plane may go away and come back (restarted, without its registry): a broken or ended
placement watch is reopened after the last version seen, with backoff (`RESUBSCRIBE_BACKOFF_S`,
doubling up to `RESUBSCRIBE_BACKOFF_MAX_S` while it keeps failing); a heartbeat answered
`known=false` registers the replica again, reporting the newest version it has received, so the
restarted control plane numbers its placements above it and the watch delivers them.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Callable

import grpc

from attention_svc.remote_experts import RemoteExperts
from moemesh.contracts.info import ServerInfo
from moemesh.contracts.knobs import MoeKnobs
from moemesh.contracts.placement import Placement
from moemesh.contracts.wire import control_grpc, control_pb2, knobs_from_proto, knobs_to_proto, placement_from_proto, server_from_proto
from moemesh.rpc.config import RpcConfig
from moemesh.rpc.server import make_channel

log = logging.getLogger(__name__)

FIRST_PLACEMENT_TIMEOUT_S = 300.0
REPORT_TIMEOUT_S = 5.0
RESUBSCRIBE_BACKOFF_S = 0.2  # first wait before reopening a broken placement watch
RESUBSCRIBE_BACKOFF_MAX_S = 5.0


def decode_update(msg) -> tuple[Placement, dict[str, ServerInfo]]:
    """PlacementUpdate -> (Placement, {server id: ServerInfo})."""
    return placement_from_proto(msg.placement), {s.server_id: server_from_proto(s) for s in msg.servers}


def engine_knob_setter(engine) -> Callable[[MoeKnobs], None]:
    """apply(knobs): every MoE layer of `engine` set to its effective top-k and capacity factor."""
    cfg = engine.model_config

    def apply(knobs: MoeKnobs) -> None:
        for layer in cfg.moe_layers:
            top_k, cf = knobs.effective(layer, cfg.top_k)
            engine.set_moe_knobs(top_k=top_k, capacity_factor=cf, layer=layer)

    return apply


class ControlFollower:
    def __init__(self, control_addr: str, rpc: RpcConfig) -> None:
        self.control_addr = control_addr
        self.channel = make_channel(control_addr, rpc)
        self.stub = control_grpc.ControlServiceStub(self.channel)
        self.replica_id = ""
        self.instance = uuid.uuid4().hex  # this process: a restarted control plane's ids may repeat
        self.experts: RemoteExperts | None = None
        self._apply_knobs: Callable[[MoeKnobs], None] | None = None
        self._knobs: dict[int, MoeKnobs] = {}  # placement version -> knobs it carries
        self._applied_knobs = MoeKnobs()  # what the engine runs with (its own defaults)
        self._updates = None  # the open WatchPlacement call
        self._seen = 0  # the newest placement version received
        self._tasks: list[asyncio.Task] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False

    async def first_placement(self, timeout_s: float = FIRST_PLACEMENT_TIMEOUT_S) -> tuple[Placement, dict[str, ServerInfo]]:
        """Opens the placement watch and waits for the first placement that places experts (v >= 1)."""
        self._loop = asyncio.get_running_loop()
        self._updates = self.stub.WatchPlacement(control_pb2.WatchPlacementRequest(after_version=0), wait_for_ready=True)
        try:
            return await asyncio.wait_for(self._first(self._updates), timeout_s)
        except asyncio.TimeoutError:
            self._updates.cancel()
            raise RuntimeError(f"control_addr: no expert placement from {self.control_addr} within {timeout_s:.0f}s") from None

    async def _first(self, updates) -> tuple[Placement, dict[str, ServerInfo]]:
        async for msg in updates:
            placement, servers = decode_update(msg)
            if placement.version >= 1:
                self._received(placement, msg)
                return placement, servers
        raise RuntimeError(f"control_addr: {self.control_addr} closed the placement stream before placing any expert")

    def _received(self, placement: Placement, msg) -> None:
        self._knobs[placement.version] = knobs_from_proto(msg.knobs)
        self._seen = max(self._seen, placement.version)

    async def start(
        self, experts: RemoteExperts, address: str, apply_knobs: Callable[[MoeKnobs], None] | None = None,
        wake: Callable[[], None] = lambda: None,
    ) -> None:
        """Registers this replica (serving at `address`), then follows placements onto `experts` and
        heartbeats its adopted version until `close`."""
        self.experts = experts
        self._apply_knobs = apply_knobs
        resp = await self._register(address, timeout_s=30)
        self._tasks.append(asyncio.create_task(self._follow(wake)))
        self._tasks.append(asyncio.create_task(self._heartbeat(address, resp.heartbeat_interval_s or 1.0)))

    async def _register(self, address: str, timeout_s: float):
        req = control_pb2.RegisterAttentionReplicaRequest(address=address, placement_version=self._seen, instance=self.instance,
                                                          knobs=knobs_to_proto(self._knobs.get(self._seen, self._applied_knobs)))
        resp = await self.stub.RegisterAttentionReplica(req, timeout=timeout_s)
        self.replica_id = resp.replica_id
        return resp

    async def _follow(self, wake: Callable[[], None]) -> None:
        """Stage every update on the experts; reopen the watch when it breaks or ends (backoff)."""
        backoff = RESUBSCRIBE_BACKOFF_S
        while True:
            why = "ended"
            try:
                async for msg in self._updates:
                    try:
                        self._apply_update(msg)
                    except Exception:  # noqa: BLE001 - e.g. an update naming a server without its address: the next one counts
                        log.exception("placement update v%d from the control plane could not be staged", msg.placement.version)
                    wake()
                    backoff = RESUBSCRIBE_BACKOFF_S
            except grpc.aio.AioRpcError as e:
                if self._closing:
                    return
                why = f"broke ({e.code().name}: {e.details()})"
            if self._closing:
                return
            log.warning("placement watch from the control plane %s: reopening it after v%d in %.1fs", why, self._seen, backoff)
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, RESUBSCRIBE_BACKOFF_MAX_S)
            self._updates = self.stub.WatchPlacement(
                control_pb2.WatchPlacementRequest(replica_id=self.replica_id, after_version=self._seen), wait_for_ready=True
            )

    def _apply_update(self, msg) -> None:
        placement, servers = decode_update(msg)
        self._received(placement, msg)
        self.experts.set_placement(placement, servers)
        if msg.dead_servers:
            self.experts.servers_dead(msg.dead_servers, f"declared dead by the control plane (placement v{placement.version})", placement.version)

    async def _heartbeat(self, address: str, interval_s: float) -> None:
        """Heartbeat the adopted version; register again when the control plane does not know us."""
        while True:
            await asyncio.sleep(interval_s)
            req = control_pb2.HeartbeatRequest(id=self.replica_id, adopted_version=self.experts.adopted_version, instance=self.instance)
            try:
                resp = await self.stub.Heartbeat(req, timeout=5)
                if not resp.known:
                    await self._register(address, timeout_s=5)
                    log.warning("the control plane did not know this replica: registered again as %s (placements seen up to v%d)",
                                self.replica_id, self._seen)
            except grpc.aio.AioRpcError as e:
                log.warning("heartbeat to the control plane failed: %s", e.details())
            except Exception:  # noqa: BLE001 - the next interval tries again: this task must not end while serving
                log.exception("heartbeat or registration with the control plane failed")

    def begin_step(self) -> None:
        """Between engine steps: adopt a staged placement and the knobs its version carries."""
        if self.experts is None:
            return
        version = self.experts.begin_step()
        knobs = self._knobs.get(version)
        for old in [v for v in self._knobs if v < version]:
            del self._knobs[old]
        if knobs is not None and knobs != self._applied_knobs and self._apply_knobs is not None:
            self._apply_knobs(knobs)
            self._applied_knobs = knobs
            log.info("placement v%d: MoE knobs %s", version, knobs.describe())

    def report_failure(self, server_id: str, detail: str) -> None:
        """From a failover thread: ReportFailure on the control plane (waits a few seconds at most)."""
        req = control_pb2.ReportFailureRequest(reporter_id=self.replica_id, server_id=server_id, detail=detail[:500])

        async def report():  # the aio call must be created on the follower's loop
            return await self.stub.ReportFailure(req, timeout=REPORT_TIMEOUT_S)

        asyncio.run_coroutine_threadsafe(report(), self._loop).result(REPORT_TIMEOUT_S + 1)

    async def close(self) -> None:
        self._closing = True
        for t in self._tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self._updates is not None:
            self._updates.cancel()
        await self.channel.close()
