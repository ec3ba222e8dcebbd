"""`moemesh up` as a real process: the serving line, a working mesh, no orphans after SIGTERM or
after a child crashes (then it exits non-zero)."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.e2e.helpers import assert_same_generation, attention_load, generate_json, run_json

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


def spread_over_replicas(router: str, replicas: list[psutil.Process]) -> None:
    """Concurrent requests land on both attention replicas (least loaded first)."""
    import grpc

    from moemesh.rpc.generation import build_request
    from tests.e2e.helpers import gen_grpc

    addresses = [f"127.0.0.1:{p.cmdline()[p.cmdline().index('--port') + 1]}" for p in replicas]
    with grpc.insecure_channel(router) as ch:
        stub = gen_grpc.GenerationStub(ch)
        streams = [stub.Generate(build_request(prompt_token_ids=[5 + i, 6, 7], max_new_tokens=20), timeout=120) for i in range(8)]
        assert all(list(s)[-1].finish_reason for s in streams)
    accepted = [attention_load(a).accepted for a in addresses]
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
        spread_over_replicas(router, [c for c in serving if "attention" in c.cmdline()])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert_all_gone(children)
    finally:
        proc.kill()


def test_a_crashed_child_stops_the_mesh_with_an_error(tiny_model_dir, tmp_path):
    proc, router, control = start_up(tiny_model_dir, tmp_path, "--expert-servers", "1")
    try:
        children = descendants(proc.pid)
        expert = next(c for c in children if "expert" in c.cmdline() and "serve" in c.cmdline())
        expert.kill()
        assert proc.wait(timeout=60) == 1
        assert "expert-0 exited" in proc.stderr.read()
        assert_all_gone(children)
    finally:
        proc.kill()


def test_up_rejects_bad_flags(tiny_model_dir, tmp_path):
    out = subprocess.run([sys.executable, "-m", "moemesh.cli.main", "up", "--model", str(tiny_model_dir), "--expert-servers", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "expert_servers must be >= 1" in out.stderr


def test_up_with_http_port_starts_the_gateway(tiny_model_dir, tmp_path):
    import httpx

    proc, router, control, http = start_up(tiny_model_dir, tmp_path, "--expert-servers", "1", "--http-port", "0",
                                           "--api-key", "k1", line=HTTP_LINE)
    try:
        children = descendants(proc.pid)
        gateway = [c for c in children if "gateway" in c.cmdline()]
        assert len(gateway) == 1 and "k1" not in " ".join(gateway[0].cmdline())  # the key travels in the environment
        assert httpx.get(f"http://{http}/health").status_code == 200
        body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"http://{http}/v1/chat/completions", json=body).status_code == 401
        r = httpx.post(f"http://{http}/v1/chat/completions", json=body, headers={"Authorization": "Bearer k1"}, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        assert httpx.get(f"http://{http}/api/mesh", headers={"x-api-key": "k1"}).json()["available"]  # --control is passed on
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert_all_gone(children)
    finally:
        proc.kill()
