"""`moemesh up` as a real process: the serving line, a working mesh, no orphans after SIGTERM or
after a child crashes (then it exits non-zero)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.fixtures.services import assert_same_generation, attention_load, generate_json, run_json

pytestmark = pytest.mark.slow  # `moemesh up` as a process: a mesh of service processes

LINE = re.compile(r"^moemesh: serving router=(127\.0\.0\.1:\d+) control=(127\.0\.0\.1:\d+)$")
HTTP_LINE = re.compile(r"^moemesh: serving router=(127\.0\.0\.1:\d+) control=(127\.0\.0\.1:\d+) http=(127\.0\.0\.1:\d+)$")


def start_up(model_dir, tmp_path, *extra, line=LINE):
    proc = subprocess.Popen(
        [sys.executable, "-m", "moemesh.cli.main", "up", "--model", str(model_dir), "--log-dir", str(tmp_path), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    printed = proc.stdout.readline().rstrip("\n")
    m = line.match(printed)
    if not m:
        proc.kill()
        pytest.fail(f"moemesh up printed {printed!r}; stderr:\n{proc.stderr.read()}")
    return (proc, *m.groups())


def mesh_rpc(token_file):
    """How to call the internal services of the `up` mesh whose log dir holds `token_file`."""
    from moemesh.rpc.config import RpcConfig
    from moemesh.rpc.security import SecurityConfig

    return RpcConfig(security=SecurityConfig(mesh_token_file=str(token_file)))


def spread_over_replicas(router: str, replicas: list[psutil.Process], rpc) -> None:
    """Concurrent requests land on both attention replicas (least loaded first)."""
    import grpc

    from moemesh.rpc.generation import build_request
    from tests.fixtures.services import gen_grpc

    addresses = [f"127.0.0.1:{p.cmdline()[p.cmdline().index('--port') + 1]}" for p in replicas]
    with grpc.insecure_channel(router) as ch:  # the router's public API: no API key in this mesh
        stub = gen_grpc.GenerationStub(ch)
        streams = [stub.Generate(build_request(prompt_token_ids=[5 + i, 6, 7], max_new_tokens=20), timeout=120) for i in range(8)]
        assert all(list(s)[-1].finish_reason for s in streams)
    accepted = [attention_load(a, rpc).accepted for a in addresses]
    assert all(n >= 2 for n in accepted), accepted


def descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def assert_all_gone(procs: list[psutil.Process], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    alive = procs
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.1)
    assert not alive, f"orphans: {[(p.pid, p.cmdline()[-6:]) for p in alive]}"


def test_up_serves_and_sigterm_stops_every_process(tiny_model_dir, tmp_path):
    proc, router, control = start_up(tiny_model_dir, tmp_path, "--expert-servers", "2", "--attention-replicas", "2")
    try:
        children = descendants(proc.pid)
        serving = [c for c in children if "serve" in c.cmdline()]
        assert len(serving) == 6  # control, 2 experts, 2 attention replicas, router
        args = ["--prompt", "Hello", "--max-new-tokens", "6"]
        assert_same_generation(generate_json(router, *args), run_json("--model", str(tiny_model_dir), *args))
        spread_over_replicas(router, [c for c in serving if "attention" in c.cmdline()], mesh_rpc(tmp_path / "mesh-token"))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert_all_gone(children)
    finally:
        proc.kill()


def ctl_status(control: str, token_file) -> dict:
    import contextlib
    import io
    import json

    from moemesh.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["ctl", "--addr", control, "--mesh-token-file", str(token_file), "--json", "status"]) == 0
    return json.loads(out.getvalue())


def test_the_mesh_token_is_made_per_mesh_and_never_on_a_command_line(tiny_model_dir, tmp_path):
    proc, router, control = start_up(tiny_model_dir, tmp_path, "--expert-servers", "1")
    try:
        token_file = tmp_path / "mesh-token"
        token = token_file.read_text().strip()
        assert len(token) >= 32 and (token_file.stat().st_mode & 0o777) == 0o600
        for c in descendants(proc.pid):
            assert not any(token in a for a in c.cmdline()), c.cmdline()
        assert int(ctl_status(control, token_file)["placement_version"]) >= 1
        import grpc

        from moemesh.contracts.wire import control_grpc, control_pb2
        with grpc.insecure_channel(control) as ch:  # without the token: refused
            with pytest.raises(grpc.RpcError) as e:
                control_grpc.ControlServiceStub(ch).GetStatus(control_pb2.GetStatusRequest(), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_a_killed_expert_server_is_restarted_and_gets_experts_again(tiny_model_dir, tmp_path):
    """SIGKILL of one expert server of an `up` mesh: streams keep succeeding (its experts fail over
    to the other server), the launcher starts it again on its port, it registers and the control
    plane places experts on it; only SIGTERM stops the mesh (exit 0)."""
    from tests.live.mesh import Workload

    proc, router, control = start_up(tiny_model_dir, tmp_path, "--expert-servers", "2")
    token_file = tmp_path / "mesh-token"
    try:
        experts = [c for c in descendants(proc.pid) if "serve" in c.cmdline() and "expert" in c.cmdline()]
        victim = experts[1]
        port = victim.cmdline()[victim.cmdline().index("--port") + 1]
        w = Workload(router, [[9 + i, 60 + 5 * i, 200 + i, 3] for i in range(4)], max_new_tokens=8, concurrency=2,
                     max_requests=30, timeout_s=120).start()
        try:
            w.wait_completed(3, 120)
            victim.kill()
            w.wait_completed(30, 300)
        finally:
            w.stop()
        assert w.errors == [] and len(w.results) == 30
        deadline = time.monotonic() + 120
        while True:
            st = ctl_status(control, token_file)
            back = [s for s in st["servers"] if s["server"]["address"].endswith(f":{port}") and s["server"].get("state") == "SERVER_STATE_SERVING"]
            if back and back[0].get("experts_held", 0) > 0:
                break
            assert time.monotonic() < deadline, f"the restarted server has no experts: {st}"
            time.sleep(0.5)
        assert proc.poll() is None  # the mesh kept running
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert "expert-1 exited" in proc.stderr.read()
    finally:
        proc.kill()


def test_a_killed_control_plane_is_restarted_and_rebuilds_the_placement_the_mesh_runs(tiny_model_dir, tmp_path):
    """SIGKILL of the control plane of an `up` mesh under load: streams keep succeeding, the launcher
    starts it again on its port, the expert servers and the attention replica register again and it
    rebuilds the placement they run (the same copies, numbered above the old version, adopted)."""
    from tests.live.mesh import Workload

    proc, router, control = start_up(tiny_model_dir, tmp_path, "--expert-servers", "2")
    token_file = tmp_path / "mesh-token"

    def copies(st):
        return [[sorted(e["server_ids"]) for e in layer["experts"]] for layer in st["placement"]["layers"]]

    try:
        before = ctl_status(control, token_file)
        victim = next(c for c in descendants(proc.pid) if "serve" in c.cmdline() and "control" in c.cmdline())
        w = Workload(router, [[9 + i, 60 + 5 * i, 200 + i, 3] for i in range(4)], max_new_tokens=8, concurrency=2,
                     max_requests=30, timeout_s=120).start()
        try:
            w.wait_completed(3, 120)
            victim.kill()
            deadline = time.monotonic() + 120
            while True:
                try:
                    st = ctl_status(control, token_file)
                except AssertionError:  # not serving again yet
                    st = None
                version = int(st["placement_version"]) if st else 0  # uint64: a string in JSON
                if version > int(before["placement_version"]) and st["replicas"] and all(
                        int(r.get("adopted_version", 0)) == version for r in st["replicas"] if r["alive"]):
                    break
                assert time.monotonic() < deadline, f"no rebuilt placement that the replica runs: {st}"
                time.sleep(0.5)
            w.wait_completed(30, 300)
        finally:
            w.stop()
        assert w.errors == [] and len(w.results) == 30
        assert copies(st) == copies(before) and len(st["servers"]) == 2
        assert proc.poll() is None  # the mesh kept running
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()


def test_up_rejects_bad_flags(tiny_model_dir, tmp_path):
    for flags, message in ((["--expert-servers", "0"], "--expert-servers must be >= 1"),
                           (["--expert-cpu-quota", "-1"], "--expert-cpu-quota must be a number of CPUs > 0")):
        out = subprocess.run([sys.executable, "-m", "moemesh.cli.main", "up", "--model", str(tiny_model_dir), *flags],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2
        assert message in out.stderr


def test_expert_cpu_quota_gives_each_expert_server_a_budget_of_its_own(tiny_model_dir, tmp_path):
    from moemesh.launcher.cpu_budget import CpuBudgets

    mode = CpuBudgets.detect().mode
    proc, router, control = start_up(tiny_model_dir, tmp_path, "--expert-servers", "2", "--expert-cpu-quota", "0.5")
    try:
        experts = [c for c in descendants(proc.pid) if "serve" in c.cmdline() and "expert" in c.cmdline()]
        assert len(experts) == 2
        for c in experts:  # a budget of half a core runs one torch thread
            assert c.cmdline()[c.cmdline().index("--num-threads") + 1] == "1"
        if mode.startswith("cgroup"):
            groups = [next(line for line in open(f"/proc/{c.pid}/cgroup") if "moemesh-" in line).split(":")[2].strip() for c in experts]
            assert len(set(groups)) == 2 and all(f"moemesh-{proc.pid}-expert-" in g for g in groups)
        elif mode == "affinity":
            assert [c.cpu_affinity() for c in experts] != [sorted(os.sched_getaffinity(0))] * 2
        args = ["--prompt", "Hello", "--max-new-tokens", "4"]
        assert_same_generation(generate_json(router, *args), run_json("--model", str(tiny_model_dir), *args))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        err = proc.stderr.read()
        assert "cpu budget per expert server" in err and "expert-1:" in err
        if mode.startswith("cgroup"):
            assert not any(f"moemesh-{proc.pid}-" in p.name for p in CpuBudgets.detect().parent.iterdir())  # removed at stop
    finally:
        proc.kill()


KEY = "gateway-and-router-key-0123"  # the API key guards both public doors


def test_up_with_http_port_starts_the_gateway(tiny_model_dir, tmp_path):
    import httpx

    proc, router, control, http = start_up(tiny_model_dir, tmp_path, "--expert-servers", "1", "--http-port", "0",
                                           "--api-key", KEY, line=HTTP_LINE)
    try:
        children = descendants(proc.pid)
        gateway = [c for c in children if "gateway" in c.cmdline()]
        assert len(gateway) == 1 and KEY not in " ".join(gateway[0].cmdline())  # the key travels in the environment
        assert httpx.get(f"http://{http}/health").status_code == 200
        body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"http://{http}/v1/chat/completions", json=body).status_code == 401
        r = httpx.post(f"http://{http}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        assert httpx.get(f"http://{http}/api/mesh", headers={"x-api-key": KEY}).json()["available"]  # --control is passed on
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert_all_gone(children)
    finally:
        proc.kill()
