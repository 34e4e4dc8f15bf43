"""Events: validation with named parameters, JSON round trip, dp_accounting conversion."""

import json
import math

import pytest
from dp_accounting import dp_event

from privacy.errors import PrivacyError, UnsupportedEvent
from privacy.events import (
    ComposedEvent,
    GaussianEvent,
    LaplaceEvent,
    PureDPEvent,
    SampledGaussianEvent,
    ZCDPEvent,
    event_from_dict,
)

EXAMPLES = [
    GaussianEvent(0.25, 1.0733, 80),
    SampledGaussianEvent(0.01, 1.1, 1000),
    SampledGaussianEvent(1 / 9, 0.8, 90, relation="replace-one"),
    SampledGaussianEvent(0.1, 1.2, 9, adaptive=True),
    ZCDPEvent(0.3, description="x"),
    ZCDPEvent.shuffled_epochs(2.0, 1, relation="replace-one", adaptive=True),
    ZCDPEvent.shuffled_epochs(2.0, 3),
    LaplaceEvent(2.0, 4.0, 3),
    PureDPEvent(0.5, description="exp mech"),
    ComposedEvent((GaussianEvent(1.0, 2.0), GaussianEvent(0.5, 1.0, 4))),
]


@pytest.mark.parametrize("event", EXAMPLES, ids=lambda e: type(e).__name__)
def test_json_round_trip(event):
    text = json.dumps(event.to_dict())
    again = event_from_dict(json.loads(text))
    assert again == event
    assert hash(again) == hash(event)


def test_events_are_frozen():
    event = GaussianEvent(1.0, 2.0)
    with pytest.raises(Exception):
        event.sigma = 3.0  # type: ignore[misc]


@pytest.mark.parametrize(
    "factory, name",
    [
        (lambda: GaussianEvent(0.0, 1.0), "sensitivity"),
        (lambda: GaussianEvent(1.0, -1.0), "sigma"),
        (lambda: GaussianEvent(1.0, math.inf), "sigma"),
        (lambda: GaussianEvent(1.0, math.nan), "sigma"),
        (lambda: GaussianEvent(1.0, 1.0, 0), "count"),
        (lambda: GaussianEvent(1.0, 1.0, relation="neighbours"), "relation"),
        (lambda: SampledGaussianEvent(0.0, 1.0), "sampling_rate"),
        (lambda: SampledGaussianEvent(1.5, 1.0), "sampling_rate"),
        (lambda: SampledGaussianEvent(0.1, 0.0), "noise_multiplier"),
        (lambda: SampledGaussianEvent(0.1, 1.0, steps=2.5), "steps"),
        (lambda: SampledGaussianEvent(0.1, 1.0, relation="zero-out"), "relation"),
        (lambda: SampledGaussianEvent(0.1, 1.0, adaptive="yes"), "adaptive"),
        (lambda: ZCDPEvent.shuffled_epochs(1.0, 1, relation="add-remove"), "zero-out"),
        (lambda: ZCDPEvent(-1.0), "rho"),
        (lambda: LaplaceEvent(1.0, 0.0), "scale"),
        (lambda: PureDPEvent(math.inf), "epsilon"),
    ],
)
def test_validation_names_parameter(factory, name):
    with pytest.raises(PrivacyError, match=name):
        factory()


def test_sampling_rate_one_is_allowed():
    assert SampledGaussianEvent(1.0, 1.0).sampling_rate == 1.0


def test_composed_refuses_mixed_relations():
    with pytest.raises(PrivacyError, match="relation"):
        ComposedEvent((GaussianEvent(1.0, 1.0), ZCDPEvent(0.1)))


def test_event_from_dict_errors():
    with pytest.raises(PrivacyError, match="type"):
        event_from_dict({"type": "nope"})
    with pytest.raises(PrivacyError, match="unknown field"):
        event_from_dict({"type": "gaussian", "sensitivity": 1, "sigma": 1, "colour": "red"})
    with pytest.raises(PrivacyError, match="gaussian"):
        event_from_dict({"type": "gaussian", "sensitivity": 1})


def test_shuffled_epochs_rho():
    # zero-out adjacency (Yu et al.'s 1/(2σ²) per epoch: sensitivity C) is the default label
    event = ZCDPEvent.shuffled_epochs(2.0, 3)
    assert event.rho == pytest.approx(3 / (2 * 4.0)) and event.relation == "zero-out"
    # replace-one: sensitivity 2C, ρ = 2/σ² per epoch (four times zero-out)
    replace = ZCDPEvent.shuffled_epochs(2.0, 3, relation="replace-one")
    assert replace.rho == pytest.approx(3 * 2 / 4.0) and replace.relation == "replace-one"


def test_adaptive_flag_is_left_out_of_json_when_false():
    """Ledgers written before the flag existed keep their bytes: a repeated release id still matches."""
    assert "adaptive" not in SampledGaussianEvent(0.1, 1.0).to_dict()
    assert SampledGaussianEvent(0.1, 1.0, adaptive=True).to_dict()["adaptive"] is True
    assert event_from_dict({"type": "zcdp", "rho": 0.1}).adaptive is False
    assert ComposedEvent((ZCDPEvent(0.1), ZCDPEvent(0.2, adaptive=True))).adaptive


def test_with_relation_only_for_mechanisms_described_without_a_relation():
    sgd = SampledGaussianEvent(0.1, 1.0, 5, relation="replace-one")
    assert sgd.with_relation("add-remove") == SampledGaussianEvent(0.1, 1.0, 5, relation="add-remove")
    assert GaussianEvent(0.25, 1.0).with_relation("add-remove") is None  # S = 2C/K was derived for replace-one
    assert GaussianEvent(0.25, 1.0).with_relation("replace-one") == GaussianEvent(0.25, 1.0)
    assert ComposedEvent((sgd, GaussianEvent(0.25, 1.0))).with_relation("add-remove") is None


def test_noise_multiplier_and_mu():
    event = GaussianEvent(0.25, 1.0, 80)
    assert event.noise_multiplier == 4.0
    assert event.mu == pytest.approx(math.sqrt(80) * 0.25)


def test_to_dp_accounting():
    g = GaussianEvent(0.5, 2.0, 3).to_dp_accounting()
    assert g == dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(4.0), 3)
    s = SampledGaussianEvent(0.02, 1.5, 7).to_dp_accounting()
    assert s == dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(0.02, dp_event.GaussianDpEvent(1.5)), 7)
    assert LaplaceEvent(2.0, 4.0).to_dp_accounting() == dp_event.LaplaceDpEvent(2.0)
    assert ZCDPEvent(0.3).to_dp_accounting() == dp_event.ZCDpEvent(0.3)
    composed = ComposedEvent((GaussianEvent(1.0, 2.0), GaussianEvent(1.0, 3.0))).to_dp_accounting()
    assert isinstance(composed, dp_event.ComposedDpEvent) and len(composed.events) == 2
    with pytest.raises(UnsupportedEvent):
        PureDPEvent(1.0).to_dp_accounting()


def test_to_dp_accounting_for_a_replace_one_inner_accountant():
    """dp_accounting's REPLACE_ONE PLD doubles an un-subsampled Gaussian's sensitivity (it reads the multiplier
    relative to a norm bound), so an explicit replace-one sensitivity S is passed as the bound S/2."""
    assert GaussianEvent(0.5, 2.0, 3).to_dp_accounting("replace-one") == dp_event.SelfComposedDpEvent(
        dp_event.GaussianDpEvent(8.0), 3)
    s = SampledGaussianEvent(0.02, 1.5, 7, relation="replace-one").to_dp_accounting("replace-one")
    assert s == dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(0.02, dp_event.GaussianDpEvent(1.5)), 7)
    with pytest.raises(UnsupportedEvent, match="relation|under"):
        SampledGaussianEvent(0.02, 1.5, 7, relation="replace-one").to_dp_accounting("add-remove")
    with pytest.raises(UnsupportedEvent, match="under"):
        SampledGaussianEvent(0.02, 1.5, 7).to_dp_accounting("replace-one")
    with pytest.raises(UnsupportedEvent, match="REPLACE_ONE"):
        LaplaceEvent(2.0, 4.0).to_dp_accounting("replace-one")
