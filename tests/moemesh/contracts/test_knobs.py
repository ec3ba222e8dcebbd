import pytest

from moemesh.contracts.knobs import LayerKnobs, MoeKnobs, check_change
from moemesh.contracts.wire import knobs_from_proto, knobs_to_proto

LAYERS, E = (0, 1, 3), 8


def test_global_and_per_layer_settings_resolve_per_layer():
    k = MoeKnobs().updated(top_k=1).updated(capacity_factor=1.25, layer=3)
    assert k.effective(0, model_top_k=2) == (1, 0.0)
    assert k.effective(3, model_top_k=2) == (1, 1.25)
    assert MoeKnobs().effective(1, model_top_k=2) == (2, 0.0)  # unset: the model's own


def test_for_layer_is_what_a_moe_layer_runs_with():
    k = MoeKnobs()
    assert k.for_layer(3) == LayerKnobs(3, None, 0.0)  # top_k None: the model's; dropless
    k2 = k.updated(top_k=4)
    assert k2.for_layer(0).top_k == 4 and k.for_layer(0).top_k is None  # immutable
    k3 = k2.updated(capacity_factor=1.5, layer=1)
    assert k3.for_layer(1) == LayerKnobs(1, 4, 1.5)
    assert k3.for_layer(0) == LayerKnobs(0, 4, 0.0)


def test_a_global_change_clears_that_field_of_layer_overrides():
    k = MoeKnobs().updated(top_k=4, capacity_factor=-2.0, layer=1)
    k = k.updated(top_k=2)
    assert k.layers == (LayerKnobs(1, None, -2.0),)
    assert k.effective(1, model_top_k=8) == (2, -2.0)
    assert k.updated(capacity_factor=0.0).layers == ()


def test_bad_values_name_the_field():
    with pytest.raises(ValueError, match="top_k"):
        MoeKnobs(top_k=0)
    with pytest.raises(ValueError, match="top_k for layer 2"):
        MoeKnobs().updated(top_k=0, layer=2)
    with pytest.raises(ValueError, match="capacity_factor"):
        MoeKnobs().updated(capacity_factor=float("nan"))


@pytest.mark.parametrize(
    "kwargs, field",
    [({"top_k": 0}, "top_k"), ({"top_k": 9}, "top_k"), ({"top_k": 1, "layer": 2}, "layer"),
     ({"capacity_factor": float("nan")}, "capacity_factor"), ({}, "top_k or capacity_factor")],
)
def test_changes_that_do_not_fit_the_model_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        check_change(LAYERS, E, **kwargs)


def test_a_change_that_fits_passes():
    check_change(LAYERS, E, top_k=8, capacity_factor=-1.0, layer=3)


def test_wire_round_trip_keeps_unset_apart_from_zero():
    k = MoeKnobs(None, 0.0, (LayerKnobs(3, 1, None),))
    msg = knobs_to_proto(k)
    assert not msg.HasField("top_k") and msg.HasField("capacity_factor")
    assert knobs_from_proto(msg) == k
    assert knobs_from_proto(knobs_to_proto(MoeKnobs())) == MoeKnobs()
