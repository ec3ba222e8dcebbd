"""`ControlServicer`: moemesh.v1.ControlService <-> `ControlPlane`. Translation and status codes only."""
from __future__ import annotations

import grpc

from control_svc.board import PlacementView
from control_svc.plane import ControlPlane
from control_svc.registry import UnknownId
from control_svc.wire import STATES, control_grpc, control_pb2, placement_to_proto, server_from_proto, server_to_proto


def update_message(view: PlacementView):
    return control_pb2.PlacementUpdate(placement=placement_to_proto(view.placement), servers=[server_to_proto(s) for s in view.servers])


class ControlServicer(control_grpc.ControlServiceServicer):
    def __init__(self, plane: ControlPlane):
        self.plane = plane

    async def RegisterExpertServer(self, request, context):
        try:
            info = self.plane.register_expert(server_from_proto(request.server))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return control_pb2.RegisterExpertServerResponse(
            server_id=info.server_id,
            placement=placement_to_proto(self.plane.board.current.placement),
            heartbeat_interval_s=self.plane.heartbeat_interval_s,
        )

    async def RegisterAttentionReplica(self, request, context):
        replica_id = self.plane.registry.register_attention(request.address)
        return control_pb2.RegisterAttentionReplicaResponse(replica_id=replica_id, heartbeat_interval_s=self.plane.heartbeat_interval_s)

    async def Heartbeat(self, request, context):
        if not request.id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "id is empty")
        adopted = request.adopted_version if request.HasField("adopted_version") else None
        known = self.plane.heartbeat(request.id, adopted, request.stats if request.HasField("stats") else None)
        rec = self.plane.registry.experts.get(request.id)
        state = STATES[rec.info.state] if rec else control_pb2.SERVER_STATE_UNSPECIFIED
        return control_pb2.HeartbeatResponse(
            known=known, placement_version=self.plane.board.version, state=state, moving=request.id in self.plane.moving
        )

    async def Drain(self, request, context):
        try:
            state, moving = self.plane.drain(request.id)
        except UnknownId as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e.args[0]))
        return control_pb2.DrainResponse(state=STATES[state], moving=moving)

    async def Deregister(self, request, context):
        try:
            self.plane.registry.deregister(request.id)
        except UnknownId as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e.args[0]))
        return control_pb2.DeregisterResponse()

    async def GetPlacement(self, request, context):
        return update_message(self.plane.board.current)

    async def WatchPlacement(self, request, context):
        async for view in self.plane.board.watch(request.after_version):
            yield update_message(view)
