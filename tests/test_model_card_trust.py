"""Every model card states its own method's trust model -- who could see what -- in the same sentence the report
prints for that method (``task.reporting.trust.trust_line``), not the trusted PATE aggregator's for every method; and it
names the classes and settings as the report does (our class names, no raw JSON)."""

import re

import pytest

from privacy.events import GaussianEvent
from privacy.ledger import Ledger
from task.reporting import trust
from task.learning.networks import build_unet, network_config
from task.reporting.results import ModelRelease, RunResults, write_run

SECURE = {"bits": 40, "participants": 4, "colluders": 1, "counted_shares": 3}
TRUSTED_PATE = "un-noised encoding"


def _trust_models():
    from server.dpfedavg_secure import who_sees_what as fedavg_secure
    from server.pate_secure import who_sees_what as pate

    return {"pate-anchored": ("trusted", pate(None)), "pate-anchored-secure": ("secure", pate(SECURE)),
            "dp-fedavg-secure": ("secure", fedavg_secure(SECURE)),
            "dp-fedavg": ("trusted", trust.federated_averaging()),
            "dp-sgd-central": ("pooled", trust.pooled(True)), "nonprivate-central": ("pooled", trust.pooled(False)),
            "public-only": ("none", trust.public_only())}


@pytest.mark.parametrize("method", list(_trust_models()))
def test_each_card_states_its_own_methods_trust_model_as_the_report_does(tmp_path, method):
    from sim.report import who_sees_what_lines

    aggregation, parties = _trust_models()[method]
    private = method not in ("nonprivate-central", "public-only")
    ledger = Ledger(tmp_path / "ledger.jsonl")
    if private:
        ledger.record(["h0", "h1"], GaussianEvent(sensitivity=0.25, sigma=1.0), "query-0")
    else:
        (tmp_path / "ledger.jsonl").touch()
    results = RunResults(method=method, epsilon_budget=8.0 if private else None, delta=1e-3 if private else None,
                         relation="replace-one" if private else None, accountant="pld" if private else None)
    results.extras = {"aggregation": aggregation, "who_sees_what": parties}
    write_run(tmp_path, results, ModelRelease(build_unet("tiny"), network_config("tiny"), {"grid": [16, 16, 16]},
                                              {"kind": "phantoms", "seed": 0}))
    card = (tmp_path / "model" / "MODEL_CARD.md").read_text()
    report_line = who_sees_what_lines([{"method": method, **results.extras}])[0]
    assert report_line.removeprefix("- ") in card                    # one source of truth: the report's sentence
    assert (TRUSTED_PATE in card) == (method == "pate-anchored")     # the trusted aggregator's claim only there
    assert "the aggregator (the PATE server) is trusted" not in card


def test_a_card_without_a_recorded_trust_model_says_so_rather_than_claiming_one():
    from task.reporting.bundle import model_card_markdown

    bundle = {"card": {"method": "x", "private": False, "epsilon": None, "epsilon_budget": None, "delta": None,
                       "relation": None, "accountant": None, "teachers": None, "hospitals": None,
                       "data_source": {"kind": "phantoms"}, "ledger_digest": "0"},
              "network": {}, "preprocessing": {"grid": [16, 16, 16]}, "weights_sha256": "0",
              "modalities": {"0": "FLAIR"}, "labels": {"1": "oedema"}}
    text = model_card_markdown(bundle)
    assert "not recorded" in text and TRUSTED_PATE not in text


def test_the_card_names_classes_as_the_report_does_and_shows_no_raw_json(tmp_path):
    from task.data.layouts import CLASSES

    (tmp_path / "ledger.jsonl").touch()
    write_run(tmp_path, RunResults(method="public-only"),
              ModelRelease(build_unet("tiny"), network_config("tiny"), {"grid": [16, 16, 16],
                                                                        "config": {"grid": [16, 16, 16]}},
                           {"kind": "phantoms", "parts": [{"name": "a", "cases": 4}]}))
    card = (tmp_path / "model" / "MODEL_CARD.md").read_text()
    assert not re.search(r"\bedema|\btumor\b", card)
    assert all(name in card for name in CLASSES.values())
    assert "{" not in card and '"' not in card                      # readable settings, not JSON
    assert "resampled to 16x16x16 voxels" in card
