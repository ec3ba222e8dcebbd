"""`moemesh ctl --addr CONTROL COMMAND`: the control plane from the command line.

CONTROL is the address `moemesh up` prints as `control=HOST:PORT`. Commands:

    status                         servers, attention replicas, load and balance
    placement                      which servers hold each (layer, expert)
    rebalance [--force] [--dry-run]
                                   solve from the observed load; switch when the cost model predicts it
                                   pays (or always); --dry-run prints the predicted gain and cost only
    set [--top-k K] [--capacity-factor C] [--layer L] [--dry-run]
                                   change routing knobs live (a new placement version carries them),
                                   with the predicted effect on the step time
    drain SERVER_ID                move a server's experts away so it can leave
    undrain SERVER_ID              a draining server serves again (and gets experts back)

The control plane requires the mesh token (`--mesh-token-file FILE` or `MOEMESH_MESH_TOKEN`;
`moemesh up` says where its token file is) and, when it serves mTLS, `--tls-cert/--tls-key/--tls-ca`.
Each prints a table, or with `--json` the response as one JSON object (proto field names).
"""
from __future__ import annotations

import argparse
import json
import math

from moemesh.cli.checks import check_address, check_timeout
from moemesh.cli.client_args import ControlClientArgs, add_client_arguments, client_args

TIMEOUT_S = 300.0  # a switch loads experts from the checkpoint: allow it time


def register(subparsers) -> None:
    p = subparsers.add_parser("ctl", help="inspect and steer the control plane (status, placement, rebalance, set, drain)")
    p.add_argument("--addr", required=True, metavar="HOST:PORT", help="the control plane (moemesh up prints control=HOST:PORT)")
    p.add_argument("--json", action="store_true", help="print the response as JSON")
    p.add_argument("--timeout", type=float, default=TIMEOUT_S, metavar="S", help="give up on the call after S seconds")
    add_client_arguments(p, ControlClientArgs)
    sub = p.add_subparsers(dest="ctl_command", required=True, metavar="COMMAND")
    json_flag = argparse.ArgumentParser(add_help=False)
    json_flag.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print the response as JSON")
    sub.add_parser("status", parents=[json_flag], help="servers, attention replicas, load and balance")
    sub.add_parser("placement", parents=[json_flag], help="which servers hold each (layer, expert)")
    r = sub.add_parser("rebalance", parents=[json_flag], help="rebalance from the observed load")
    r.add_argument("--force", action="store_true", help="switch whenever the solver changes the placement")
    r.add_argument("--dry-run", action="store_true", help="plan and price the rebalance, but do not switch")
    s = sub.add_parser("set", parents=[json_flag], help="change top-k and/or capacity factor live")
    s.add_argument("--top-k", type=int, default=None, metavar="K")
    s.add_argument("--capacity-factor", type=float, default=None, metavar="C", help=">0 capacity, 0 dropless, <0 dropless up to |C|")
    s.add_argument("--layer", type=int, default=None, metavar="L", help="one MoE layer (default: all)")
    s.add_argument("--dry-run", action="store_true", help="predict the change's effect, but do not make it")
    d = sub.add_parser("drain", parents=[json_flag], help="move a server's experts away so it can leave")
    d.add_argument("server_id", metavar="SERVER_ID", help="e.g. expert-1 (see status)")
    u = sub.add_parser("undrain", parents=[json_flag], help="a draining server serves again and gets experts back")
    u.add_argument("server_id", metavar="SERVER_ID", help="e.g. expert-1 (see status)")
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from moemesh.contracts.wire import control_grpc, control_pb2
    from moemesh.rpc.server import make_sync_channel

    check_address("--addr", ns.addr)
    check_timeout("--timeout", ns.timeout)
    if ns.ctl_command == "set":
        check_knobs(ns)
    # a bad flag or a refused or failed call reaches moemesh.cli.main, which prints it as one line
    with make_sync_channel(ns.addr, client_args(ControlClientArgs, ns).rpc()) as channel:
        resp = call(control_grpc.ControlServiceStub(channel), control_pb2, ns)
    if ns.json:
        print(json.dumps(MessageToDict(resp, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)))
    else:
        print(render(ns.ctl_command, resp))
    return 0


def check_knobs(ns: argparse.Namespace) -> None:
    """What the command line can tell before asking the control plane (which checks against the model)."""
    if ns.top_k is None and ns.capacity_factor is None:
        raise ValueError("--top-k and/or --capacity-factor: give at least one")
    if ns.top_k is not None and ns.top_k < 1:
        raise ValueError(f"--top-k: must be >= 1, got {ns.top_k}")
    if ns.capacity_factor is not None and not math.isfinite(ns.capacity_factor):
        raise ValueError(f"--capacity-factor: must be a finite number, got {ns.capacity_factor}")
    if ns.layer is not None and ns.layer < 0:
        raise ValueError(f"--layer: must be >= 0, got {ns.layer}")


def call(stub, pb, ns: argparse.Namespace):
    t = ns.timeout
    if ns.ctl_command == "status":
        return stub.GetStatus(pb.GetStatusRequest(), timeout=t)
    if ns.ctl_command == "placement":
        return stub.GetPlacement(pb.GetPlacementRequest(), timeout=t)
    if ns.ctl_command == "rebalance":
        return stub.Rebalance(pb.RebalanceRequest(force=ns.force, dry_run=ns.dry_run), timeout=t)
    if ns.ctl_command == "set":
        req = pb.SetKnobsRequest(top_k=ns.top_k, capacity_factor=ns.capacity_factor, layer=ns.layer, dry_run=ns.dry_run)
        return stub.SetKnobs(req, timeout=t)
    if ns.ctl_command == "undrain":
        return stub.Undrain(pb.UndrainRequest(id=ns.server_id), timeout=t)
    return stub.Drain(pb.DrainRequest(id=ns.server_id), timeout=t)


def render(command: str, resp) -> str:
    from moemesh.contracts.wire import STATE_NAMES, knobs_from_proto, placement_from_proto

    if command == "status":
        lines = [
            f"placement v{resp.placement_version}  balancedness {resp.balancedness:.3f}  window tokens {resp.window_tokens}"
            f"{'  (switching)' if resp.switching else ''}",
            f"knobs: {knobs_from_proto(resp.knobs).describe()}",
            "",
            table(
                ["SERVER", "ADDRESS", "STATE", "DEVICE", "EXPERTS", "TOKENS", "QUEUE", "BUSY_S", "GPU", "HEARTBEAT_S"],
                [[s.server.server_id, s.server.address, STATE_NAMES.get(s.server.state, "?"), s.server.device, s.experts_held,
                  s.window_tokens, s.queue_depth, f"{s.busy_seconds:.2f}",
                  f"{s.gpu.utilization:.0%} {s.gpu.memory_used_bytes >> 20}MiB {s.gpu.power_watts:.0f}W" if s.gpu.available else "none",
                  f"{s.seconds_since_heartbeat:.1f}"] for s in resp.servers],
            ),
            "",
            table(
                ["REPLICA", "ADDRESS", "ADOPTED", "ALIVE", "HEARTBEAT_S"],
                [[r.replica_id, r.address, f"v{r.adopted_version}", "yes" if r.alive else "no", f"{r.seconds_since_heartbeat:.1f}"]
                 for r in resp.replicas],
            ),
        ]
        return "\n".join(lines)
    if command == "placement":
        p = placement_from_proto(resp.placement)
        rows = [[layer, e, ",".join(copies)] for layer in p.layers for e, copies in enumerate(p.replicas[layer])]
        return f"placement v{p.version}  knobs: {knobs_from_proto(resp.knobs).describe()}\n" + table(["LAYER", "EXPERT", "SERVERS"], rows)
    if command == "rebalance":
        if resp.dry_run:
            head = f"dry run on placement v{resp.placement_version}: " + (resp.reason or "the plan would be switched in")
        elif resp.switched:
            head = f"switched to placement v{resp.placement_version}"
        else:
            head = f"kept placement v{resp.placement_version}: {resp.reason}"
        lines = [head, f"balancedness {resp.balancedness_before:.3f} -> {resp.balancedness_after:.3f}, "
                       f"{resp.moves} expert copies {'to load' if resp.dry_run or not resp.switched else 'loaded'}"]
        if resp.predicted_gain:
            bound = ", bound by a server's CPU budget" if resp.budget_bound else ""
            lines.append(f"predicted step {resp.step_ms_before:.2f} ms -> {resp.step_ms_after:.2f} ms ({resp.predicted_gain:.3f}x{bound}), "
                         f"switch cost {resp.bytes_to_load / 1e6:.1f} MB, {resp.switch_seconds:.2f} s of loading "
                         f"({'calibrated from the expert servers' if resp.calibrated else 'priors: no server reports yet'})")
        return "\n".join(lines)
    if command == "set":
        verb = "would carry" if resp.dry_run else "carries"
        line = f"placement v{resp.placement_version} {verb} knobs: {knobs_from_proto(resp.knobs).describe()}"
        if resp.predicted_gain:
            bound = ", bound by a server's CPU budget" if resp.budget_bound else ""
            line += f"\npredicted step {resp.step_ms_before:.2f} ms -> {resp.step_ms_after:.2f} ms ({resp.predicted_gain:.3f}x{bound})"
        return line
    if command == "undrain":
        return f"state {STATE_NAMES.get(resp.state, '?')}; experts {'placed on it again' if resp.placing else 'not placed (nothing to place, or no placement yet)'}"
    return f"state {STATE_NAMES.get(resp.state, '?')}; experts {'moving away' if resp.moving else 'not moved (none held, or no room elsewhere)'}"


def table(header: list[str], rows: list[list[object]]) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)
