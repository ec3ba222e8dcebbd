"""The expert server's device: its config takes cpu or cuda:N; the core's select_device checks it exists."""
import asyncio

import pytest
import torch

from expert_svc.config import ExpertServerConfig
from expert_svc.server import create_server
from tests.fixtures.auth import TEST_RPC


@pytest.mark.parametrize("device", ["cpu", "cuda:0", "cuda:3"])
def test_config_takes_cpu_or_an_indexed_cuda_device(device):
    assert ExpertServerConfig(model_dir="/m", device=device, rpc=TEST_RPC).device == device


@pytest.mark.parametrize("device", ["cuda", "gpu", "cuda:x", ""])
def test_other_devices_name_the_field(device):
    with pytest.raises(ValueError, match="device must be cpu or cuda:N"):
        ExpertServerConfig(model_dir="/m", device=device, rpc=TEST_RPC)


def test_a_cuda_device_this_machine_lacks_is_refused_before_anything_loads(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device 'cuda:0'"):
        asyncio.run(create_server(ExpertServerConfig(model_dir=str(tmp_path / "absent"), device="cuda:0", rpc=TEST_RPC)))
