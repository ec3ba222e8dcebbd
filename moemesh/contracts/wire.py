"""The shared contracts <-> their moemesh.v1 messages (control.proto and attention.proto)."""
from __future__ import annotations

from moemesh.contracts.info import LoadReport, ModelInfo, ServerInfo
from moemesh.contracts.knobs import LayerKnobs, MoeKnobs
from moemesh.contracts.placement import LayerExperts, Placement
from moemesh.rpc.protos import load

control_pb2, control_grpc = load("control")
expert_pb2, _ = load("expert")
attention_pb2, attention_grpc = load("attention")

STATES = {
    "serving": control_pb2.SERVER_STATE_SERVING,
    "draining": control_pb2.SERVER_STATE_DRAINING,
    "dead": control_pb2.SERVER_STATE_DEAD,
}
STATE_NAMES = {v: k for k, v in STATES.items()}


def _opt(msg, name: str):
    return getattr(msg, name) if msg.HasField(name) else None


def placement_to_proto(p: Placement):
    return control_pb2.Placement(
        version=p.version,
        layers=[
            control_pb2.LayerPlacement(layer=layer, experts=[control_pb2.ExpertReplicas(server_ids=list(c)) for c in p.replicas[layer]])
            for layer in p.layers
        ],
    )


def placement_from_proto(msg) -> Placement:
    return Placement(
        version=msg.version,
        replicas={lp.layer: tuple(tuple(er.server_ids) for er in lp.experts) for lp in msg.layers},
    )


def held_to_proto(held: LayerExperts):
    """layer -> experts as a moemesh.v1.ExpertSet."""
    return expert_pb2.ExpertSet(experts=[expert_pb2.LayerExperts(layer=l, expert_ids=list(es)) for l, es in sorted(held.items())])


def held_from_proto(msg) -> LayerExperts:
    """A moemesh.v1.ExpertSet as layer -> experts (ascending, each once; empty layers left out)."""
    out: dict[int, set[int]] = {}
    for le in msg.experts:
        out.setdefault(le.layer, set()).update(le.expert_ids)
    return {layer: tuple(sorted(es)) for layer, es in sorted(out.items()) if es}


def server_to_proto(s: ServerInfo):
    return control_pb2.ExpertServerInfo(
        server_id=s.server_id,
        address=s.address,
        device=s.device,
        memory_bytes=s.memory_bytes,
        slot_budget=s.slot_budget,
        host_id=s.host_id,
        dist_addr=s.dist_addr,
        state=STATES[s.state],
    )


def server_from_proto(msg) -> ServerInfo:
    return ServerInfo(
        server_id=msg.server_id,
        address=msg.address,
        device=msg.device or "cpu",
        memory_bytes=msg.memory_bytes,
        slot_budget=msg.slot_budget,
        host_id=msg.host_id,
        dist_addr=msg.dist_addr,
        state=STATE_NAMES.get(msg.state, "serving"),
    )


def knobs_to_proto(k: MoeKnobs):
    """Unset values stay unset on the wire (proto3 `optional`): 0 is a value, not "the model's"."""
    msg = control_pb2.MoeKnobs(
        layers=[control_pb2.LayerKnobs(layer=s.layer, top_k=s.top_k, capacity_factor=s.capacity_factor) for s in k.layers]
    )
    if k.top_k is not None:
        msg.top_k = k.top_k
    if k.capacity_factor is not None:
        msg.capacity_factor = k.capacity_factor
    return msg


def knobs_from_proto(msg) -> MoeKnobs:
    return MoeKnobs(
        _opt(msg, "top_k"),
        _opt(msg, "capacity_factor"),
        tuple(LayerKnobs(l.layer, _opt(l, "top_k"), _opt(l, "capacity_factor")) for l in msg.layers),
    )


def load_to_proto(load: LoadReport):
    return attention_pb2.LoadReport(
        waiting=load.waiting, running=load.running, free_blocks=load.free_blocks,
        total_blocks=load.total_blocks, serving=load.serving, accepted=load.accepted,
    )


def load_from_proto(msg) -> LoadReport:
    return LoadReport(msg.waiting, msg.running, msg.free_blocks, msg.total_blocks, msg.serving, msg.accepted)


def model_info_to_proto(i: ModelInfo):
    """As an attention replica reports it (`ReplicaInfo`); the router's name and chat template stay out."""
    return attention_pb2.ReplicaInfo(
        architecture=i.architecture, vocab_size=i.vocab_size, max_context=i.max_context,
        max_new_tokens_limit=i.max_new_tokens_limit, eos_token_ids=i.eos_token_ids,
        num_experts=i.num_experts, experts_per_token=i.experts_per_token, num_layers=i.num_layers,
        model_dir=i.model_dir, placement_version=i.placement_version,
        kv_block_size=i.kv_block_size, prefix_caching=i.prefix_caching,
    )


def model_info_from_proto(msg) -> ModelInfo:
    return ModelInfo(
        architecture=msg.architecture,
        vocab_size=msg.vocab_size,
        max_context=msg.max_context,
        max_new_tokens_limit=msg.max_new_tokens_limit,
        eos_token_ids=tuple(msg.eos_token_ids),
        num_experts=msg.num_experts,
        experts_per_token=msg.experts_per_token,
        num_layers=msg.num_layers,
        model_dir=msg.model_dir,
        placement_version=msg.placement_version,
        kv_block_size=msg.kv_block_size,
        prefix_caching=msg.prefix_caching,
    )
