import pytest

from moemesh.moe.knobs import LayerKnobs, MoeKnobs


def test_global_and_per_layer_updates():
    k = MoeKnobs()
    assert k.for_layer(3) == LayerKnobs(None, 0.0)
    k2 = k.updated(top_k=4)
    assert k2.for_layer(0).top_k == 4 and k.for_layer(0).top_k is None  # immutable
    k3 = k2.updated(capacity_factor=1.5, layer=1)
    assert k3.for_layer(1) == LayerKnobs(4, 1.5)
    assert k3.for_layer(0) == LayerKnobs(4, 0.0)


def test_bad_top_k():
    with pytest.raises(ValueError, match="top_k"):
        MoeKnobs(top_k=0)
    with pytest.raises(ValueError, match="top_k for layer 2"):
        MoeKnobs().updated(top_k=0, layer=2)
