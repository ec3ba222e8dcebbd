"""`ControlServicer`: moemesh.v1.ControlService <-> `ControlPlane`. Translation only: a `MeshError` from the
plane aborts the call with its status and message."""
from __future__ import annotations

import grpc

from control_svc.board import PlacementView
from control_svc.plane import ControlPlane
from control_svc.status import ControlStatus, gather_status
from moemesh.contracts.wire import (
    STATES, control_grpc, control_pb2, held_from_proto, knobs_from_proto, knobs_to_proto, placement_to_proto, server_from_proto, server_to_proto,
)
from moemesh.errors import MeshError
from moemesh.rpc.protos import load

SERVICE_NAME = "moemesh.v1.ControlService"
expert_pb2, _ = load("expert")


def update_message(view: PlacementView):
    return control_pb2.PlacementUpdate(
        placement=placement_to_proto(view.placement), servers=[server_to_proto(s) for s in view.servers], knobs=knobs_to_proto(view.knobs),
        dead_servers=view.dead,
    )


def status_message(st: ControlStatus):
    servers = []
    for s in st.servers:
        msg = control_pb2.ExpertServerStatus(
            server=server_to_proto(s.info), seconds_since_heartbeat=s.seconds_since_heartbeat,
            experts_held=s.experts_held, window_tokens=s.window_tokens,
        )
        if s.stats is not None:
            msg.queue_depth = s.stats.queue_depth
            msg.busy_seconds = s.stats.busy_seconds
            msg.gpu.CopyFrom(s.stats.gpu)
            msg.window_work.CopyFrom(s.stats.window_work)
        servers.append(msg)
    return control_pb2.StatusResponse(
        placement_version=st.placement.version, balancedness=st.balancedness, window_tokens=st.window_tokens,
        servers=servers,
        replicas=[
            control_pb2.AttentionReplicaStatus(replica_id=r.replica_id, address=r.address, adopted_version=r.adopted_version,
                                               alive=r.alive, seconds_since_heartbeat=r.seconds_since_heartbeat)
            for r in st.replicas
        ],
        knobs=knobs_to_proto(st.knobs), switching=st.switching, placement=placement_to_proto(st.placement),
        expert_loads=[
            expert_pb2.ExpertLoad(layer=layer, expert_id=e, tokens=n) for layer, row in st.expert_loads for e, n in enumerate(row)
        ],
    )


class ControlServicer(control_grpc.ControlServiceServicer):
    def __init__(self, plane: ControlPlane):
        self.plane = plane

    async def RegisterExpertServer(self, request, context):
        try:
            info = self.plane.register_expert(server_from_proto(request.server), held_from_proto(request.held), request.placement_version,
                                              request.instance)
        except MeshError as e:
            await context.abort(e.code, e.message)
        return control_pb2.RegisterExpertServerResponse(
            server_id=info.server_id,
            placement=placement_to_proto(self.plane.board.current.placement),
            heartbeat_interval_s=self.plane.heartbeat_interval_s,
        )

    async def RegisterAttentionReplica(self, request, context):
        try:
            knobs = knobs_from_proto(request.knobs) if request.HasField("knobs") else None
            replica_id = self.plane.register_attention(request.address, request.placement_version, request.instance, knobs)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"knobs: {e}")
        except MeshError as e:
            await context.abort(e.code, e.message)
        return control_pb2.RegisterAttentionReplicaResponse(replica_id=replica_id, heartbeat_interval_s=self.plane.heartbeat_interval_s)

    async def Heartbeat(self, request, context):
        if not request.id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "id is empty")
        adopted = request.adopted_version if request.HasField("adopted_version") else None
        try:
            known = self.plane.heartbeat(request.id, adopted, request.stats if request.HasField("stats") else None, request.instance)
        except MeshError as e:
            await context.abort(e.code, e.message)
        rec = self.plane.registry.experts.get(request.id)
        state = STATES[rec.info.state] if rec else control_pb2.SERVER_STATE_UNSPECIFIED
        return control_pb2.HeartbeatResponse(
            known=known, placement_version=self.plane.board.version, state=state, moving=request.id in self.plane.moving
        )

    async def Drain(self, request, context):
        try:
            state, moving = self.plane.drain(request.id)
        except MeshError as e:
            await context.abort(e.code, e.message)
        return control_pb2.DrainResponse(state=STATES[state], moving=moving)

    async def Undrain(self, request, context):
        try:
            state, placing = self.plane.undrain(request.id)
        except MeshError as e:
            await context.abort(e.code, e.message)
        return control_pb2.UndrainResponse(state=STATES[state], placing=placing)

    async def Deregister(self, request, context):
        try:
            self.plane.registry.deregister(request.id)
        except MeshError as e:
            await context.abort(e.code, e.message)
        return control_pb2.DeregisterResponse()

    async def GetPlacement(self, request, context):
        return update_message(self.plane.board.current)

    async def WatchPlacement(self, request, context):
        async for view in self.plane.board.watch(request.after_version):
            yield update_message(view)

    async def GetStatus(self, request, context):
        return status_message(gather_status(self.plane))

    async def Rebalance(self, request, context):
        try:
            plan = await self.plane.rebalance(force=request.force, dry_run=request.dry_run)
            calibrated = self.plane.cost_inputs(self.plane.board.current).costs.calibrated
        except MeshError as e:
            await context.abort(e.code, e.message)
        resp = control_pb2.RebalanceResponse(
            switched=plan.placement is not None and not request.dry_run, placement_version=self.plane.board.version,
            balancedness_before=plan.before, balancedness_after=plan.after, moves=plan.moves, reason=plan.reason,
            dry_run=request.dry_run, calibrated=calibrated,
        )
        if plan.prediction is not None:
            p = plan.prediction
            resp.predicted_gain, resp.step_ms_before, resp.step_ms_after = p.gain, 1e3 * p.step_s_before, 1e3 * p.step_s_after
            resp.budget_bound = p.budget_bound
        if plan.switch is not None:
            resp.bytes_to_load, resp.switch_seconds = plan.switch.bytes, plan.switch.seconds
        return resp

    async def SetKnobs(self, request, context):
        top_k = request.top_k if request.HasField("top_k") else None
        cf = request.capacity_factor if request.HasField("capacity_factor") else None
        layer = request.layer if request.HasField("layer") else None
        try:
            self.plane.check_knobs(top_k, cf, layer)
            p = self.plane.predict_knobs(top_k, cf, layer)
            view = self.plane.board.current if request.dry_run else await self.plane.set_knobs(top_k, cf, layer)
        except MeshError as e:
            await context.abort(e.code, e.message)
        knobs = view.knobs.updated(top_k, cf, layer) if request.dry_run else view.knobs
        return control_pb2.SetKnobsResponse(
            placement_version=view.placement.version, knobs=knobs_to_proto(knobs), predicted_gain=p.gain,
            step_ms_before=1e3 * p.step_s_before, step_ms_after=1e3 * p.step_s_after, dry_run=request.dry_run, budget_bound=p.budget_bound,
        )

    async def ReportFailure(self, request, context):
        if not request.server_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "server_id is empty")
        dead = await self.plane.report_failure(request.server_id, request.detail)
        return control_pb2.ReportFailureResponse(declared_dead=dead, placement_version=self.plane.board.version)
