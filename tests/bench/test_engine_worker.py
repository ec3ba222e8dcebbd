"""bench/engine_worker.py: an engine in a spawned process, its load report, rates, memory and errors."""
from __future__ import annotations

import pytest

from bench.engine_worker import EngineProcess
from moemesh.engine import EngineConfig

pytestmark = pytest.mark.slow  # an engine in a spawned process


def test_engine_process_loads_decodes_and_reports_memory(tiny_shape_dir):
    path = tiny_shape_dir("qwen3-sparse-tiny")
    with EngineProcess(EngineConfig(str(path), dtype="bfloat16", max_num_seqs=4, kv_cache_tokens=256)) as engine:
        assert engine.load.load_s > 0 and engine.load.rss_before > 0
        one = engine.decode([[5, 17, 301]], 5)
        many = engine.decode([[5, 17, 301], [9, 8, 7], [1, 2, 3, 4]], 5)
        mem = engine.memory()
    for r in (one, many):
        assert r.wall > 0 and r.cpu > 0 and r.step_s > 0
    assert many.wall * many.step_s == pytest.approx(3, rel=1e-6)  # tokens per step: 3 sequences decode together
    assert mem.peak_rss >= mem.rss_anon + mem.rss_file > engine.load.rss_before // 2


def test_an_engine_that_fails_to_load_raises_with_its_traceback(tmp_path):
    with pytest.raises(RuntimeError, match="(?s)engine process failed.*does not exist"):
        EngineProcess(EngineConfig(str(tmp_path / "missing")))


def test_a_failing_request_raises_and_the_engine_goes_on(tiny_shape_dir):
    path = tiny_shape_dir("qwen3-sparse-tiny")
    with EngineProcess(EngineConfig(str(path), kv_cache_tokens=64)) as engine:
        with pytest.raises(RuntimeError, match="is not a token id"):
            engine.decode([[10**9]], 3)
        assert engine.decode([[5, 6]], 3).wall > 0
