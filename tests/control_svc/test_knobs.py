import pytest

from control_svc.knobs import LayerKnobSetting, RoutingKnobs
from control_svc.wire import knobs_from_proto, knobs_to_proto

LAYERS, E = (0, 1, 3), 8


def test_global_and_per_layer_settings_resolve_per_layer():
    k = RoutingKnobs().updated(LAYERS, E, top_k=1).updated(LAYERS, E, capacity_factor=1.25, layer=3)
    assert k.effective(0, model_top_k=2) == (1, 0.0)
    assert k.effective(3, model_top_k=2) == (1, 1.25)
    assert RoutingKnobs().effective(1, model_top_k=2) == (2, 0.0)  # unset: the model's own


def test_a_global_change_clears_that_field_of_layer_overrides():
    k = RoutingKnobs().updated(LAYERS, E, top_k=4, capacity_factor=-2.0, layer=1)
    k = k.updated(LAYERS, E, top_k=2)
    assert k.layers == (LayerKnobSetting(1, None, -2.0),)
    assert k.effective(1, model_top_k=8) == (2, -2.0)
    assert k.updated(LAYERS, E, capacity_factor=0.0).layers == ()


@pytest.mark.parametrize(
    "kwargs, field",
    [({"top_k": 0}, "top_k"), ({"top_k": 9}, "top_k"), ({"top_k": 1, "layer": 2}, "layer"),
     ({"capacity_factor": float("nan")}, "capacity_factor"), ({}, "top_k or capacity_factor")],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RoutingKnobs().updated(LAYERS, E, **kwargs)


def test_wire_round_trip_keeps_unset_apart_from_zero():
    k = RoutingKnobs(None, 0.0, (LayerKnobSetting(3, 1, None),))
    msg = knobs_to_proto(k)
    assert not msg.HasField("top_k") and msg.HasField("capacity_factor")
    assert knobs_from_proto(msg) == k
    assert knobs_from_proto(knobs_to_proto(RoutingKnobs())) == RoutingKnobs()
