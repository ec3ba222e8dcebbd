"""Tiny checkpoints of the newer families, each built once per session (see tiny_families.py)."""
import pytest

from tests.moemesh.models.tiny_families import expected_outputs, make_checkpoint


@pytest.fixture(scope="session")
def build_family(tmp_path_factory):
    """name -> (path, transformers model, {prompt: (prompt logprobs, greedy tokens)})."""
    built = {}

    def get(name: str):
        if name not in built:
            path, model = make_checkpoint(name, tmp_path_factory.mktemp(name))
            built[name] = (path, model, expected_outputs(model))
        return built[name]

    return get


@pytest.fixture
def family_checkpoint(request, build_family):
    """Indirectly parametrized with a tiny_families.VARIANTS name."""
    return build_family(request.param)
