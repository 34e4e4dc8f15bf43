"""Model bundles carry a privacy card consistent with their ledger; tampering is refused."""

import json

import pytest

from privacy.events import GaussianEvent
from privacy.ledger import Ledger
from task.reporting.bundle import BundleError, CardGuarantee, load_bundle, privacy_card, save_bundle
from task.learning.networks import build_unet, network_config


def _private_run(tmp_path):
    ledger = Ledger(tmp_path / "ledger.jsonl")
    for i in range(5):
        ledger.record(["hospital-0", "hospital-1"], GaussianEvent(sensitivity=0.25, sigma=1.0), f"query-{i}")
    ledger.record(["hospital-0"], GaussianEvent(sensitivity=0.5, sigma=1.0), "query-5")  # hospital-1 dropped out
    model = build_unet("tiny")
    card = privacy_card(method="pate-ae", ledger_path=tmp_path / "ledger.jsonl",
                        guarantee=CardGuarantee(delta=1e-3, epsilon_budget=8.0, relation="replace-one",
                                                accountant="gdp-exact"),
                        teachers=8, hospitals=2, data_source={"kind": "phantoms", "seed": 0})
    save_bundle(tmp_path, model, network_config("tiny"), {"grid": [16, 16, 16]}, card)
    return model, card, ledger


def test_card_epsilon_is_the_worst_owner_from_the_ledger(tmp_path):
    _, card, ledger = _private_run(tmp_path)
    worst = max(ledger.spent(o, 1e-3).epsilon for o in ledger.owners())
    assert card["epsilon"] == pytest.approx(worst)
    assert card["epsilon"] == pytest.approx(ledger.spent("hospital-0", 1e-3).epsilon)
    assert card["epsilon"] > ledger.spent("hospital-1", 1e-3).epsilon
    loaded = load_bundle(tmp_path)
    assert loaded.card["relation"] == "replace-one"
    text = (tmp_path / "model" / "MODEL_CARD.md").read_text()
    assert "replace-one" in text and f"{card['epsilon']:.4g}" in text


def test_loaded_model_has_the_saved_weights(tmp_path):
    model, _, _ = _private_run(tmp_path)
    loaded = load_bundle(tmp_path).model
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert (a == b).all(), name


def test_tampered_weights_are_refused(tmp_path):
    _private_run(tmp_path)
    weights = tmp_path / "model" / "weights.pt"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="weights do not match"):
        load_bundle(tmp_path)


@pytest.mark.parametrize("tamper, message", [
    (lambda card: card.update(epsilon=card["epsilon"] / 2), "ledger gives"),
    (lambda card: card.pop("relation"), "incomplete"),
    (lambda card: card.update(ledger_digest="0" * 64), "digest differs"),
    (lambda card: card.update(private=False, epsilon=None), "private=False"),
])
def test_tampered_card_is_refused(tmp_path, tamper, message):
    _private_run(tmp_path)
    bundle_file = tmp_path / "model" / "bundle.json"
    bundle = json.loads(bundle_file.read_text())
    tamper(bundle["card"])
    bundle_file.write_text(json.dumps(bundle))
    with pytest.raises(BundleError, match=message):
        load_bundle(tmp_path)


def test_ledger_grown_after_the_card_is_refused(tmp_path):
    _private_run(tmp_path)
    Ledger(tmp_path / "ledger.jsonl").record(["hospital-1"], GaussianEvent(sensitivity=0.25, sigma=1.0), "late")
    with pytest.raises(BundleError, match="digest differs"):
        load_bundle(tmp_path)


def test_missing_card_and_missing_bundle(tmp_path):
    with pytest.raises(BundleError, match="no model bundle"):
        load_bundle(tmp_path)
    _private_run(tmp_path)
    bundle_file = tmp_path / "model" / "bundle.json"
    bundle = json.loads(bundle_file.read_text())
    del bundle["card"]
    bundle_file.write_text(json.dumps(bundle))
    with pytest.raises(BundleError, match="card is missing"):
        load_bundle(tmp_path)


def test_nonprivate_card_says_so(tmp_path):
    card = privacy_card(method="nonprivate-central", ledger_path=None,
                        data_source={"kind": "phantoms", "seed": 0})
    assert card["private"] is False and card["epsilon"] is None
    save_bundle(tmp_path, build_unet("tiny"), network_config("tiny"), {"grid": [16, 16, 16]}, card)
    assert "Privacy: none" in (tmp_path / "model" / "MODEL_CARD.md").read_text()
    assert load_bundle(tmp_path).card["private"] is False


def _edit_bundle(tmp_path, edit):
    bundle_file = tmp_path / "model" / "bundle.json"
    bundle = json.loads(bundle_file.read_text())
    edit(bundle)
    bundle_file.write_text(json.dumps(bundle, indent=2))


@pytest.mark.parametrize("edit", [
    lambda b: b["preprocessing"].update(grid=[20, 20, 20]),              # changes every prediction
    lambda b: b["card"].update(epsilon_budget=80.0),                     # a privacy claim
    lambda b: b["card"].update(teachers=1),
    lambda b: b["card"].update(data_source={"kind": "BraTS 2021"}),
    lambda b: b["card"].update(released_with={"combined_epsilon": 0.1, "hospital_ledgers": "../nowhere/"}),
    lambda b: b["network"].update(note="edited"),
    lambda b: b["labels"].update({"3": "necrosis"}),
    lambda b: b.update(model_card_sha256="0" * 64),
], ids=["grid", "epsilon_budget", "teachers", "data_source", "released_with", "network", "labels", "card_digest"])
def test_every_field_of_bundle_json_is_covered_by_its_digest(tmp_path, edit):
    _private_run(tmp_path)
    _edit_bundle(tmp_path, edit)
    with pytest.raises(BundleError, match="do not match|does not match") as raised:
        load_bundle(tmp_path)
    assert len(str(raised.value).splitlines()) == 1
    with pytest.raises(BundleError):   # the ledger check skipped: the digest still refuses it
        load_bundle(tmp_path, verify_ledger=False)


def test_an_edited_model_card_text_is_refused(tmp_path):
    _private_run(tmp_path)
    card = tmp_path / "model" / "MODEL_CARD.md"
    card.write_text(card.read_text().replace("differential privacy", "differential privacy (ε = 0.1)"))
    with pytest.raises(BundleError, match="MODEL_CARD.md: does not match"):
        load_bundle(tmp_path)
    card.unlink()
    with pytest.raises(BundleError, match="model card is missing"):
        load_bundle(tmp_path)


def test_a_bundle_without_its_digest_is_refused(tmp_path):
    _private_run(tmp_path)
    _edit_bundle(tmp_path, lambda b: (b.pop("bundle_sha256"), b.update(version=1)))
    with pytest.raises(BundleError, match="without a digest over its fields"):
        load_bundle(tmp_path)


def test_attaching_a_release_reseals_the_bundle(tmp_path):
    from task.reporting.bundle import attach_release

    _private_run(tmp_path)
    (tmp_path / "hospital-ledgers").mkdir()
    attach_release(tmp_path, {"combined_epsilon": None, "delta": 1e-3, "relation": None, "accountant": None,
                              "hospital_ledgers": "hospital-ledgers/", "hospital_ledger_digests": {}})
    assert load_bundle(tmp_path).card["released_with"]["combined_epsilon"] is None
    assert "no private release" in (tmp_path / "model" / "MODEL_CARD.md").read_text()


def test_tampered_bundle_is_a_one_line_error_in_predict(tmp_path, capsys):
    from sim.cli import main

    _private_run(tmp_path)
    _edit_bundle(tmp_path, lambda b: b["preprocessing"].update(grid=[20, 20, 20]))
    assert main(["predict", "--model", str(tmp_path), "--image", str(tmp_path / "x.nii.gz"),
                 "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err.strip()
    assert "bundle_sha256" in err and len(err.splitlines()) == 1


def test_attaching_a_release_to_an_edited_bundle_is_refused_not_resealed(tmp_path):
    from task.reporting.bundle import attach_release

    _private_run(tmp_path)
    _edit_bundle(tmp_path, lambda b: b["preprocessing"].update(grid=[20, 20, 20]))
    (tmp_path / "hospital-ledgers").mkdir()
    with pytest.raises(BundleError, match="bundle_sha256"):
        attach_release(tmp_path, {"combined_epsilon": None, "delta": 1e-3, "relation": None, "accountant": None,
                                  "hospital_ledgers": "hospital-ledgers/", "hospital_ledger_digests": {}})
    with pytest.raises(BundleError, match="bundle_sha256"):
        load_bundle(tmp_path)
