"""Model bundles: a trained model that can leave the simulation, with its privacy card.

Layout, inside a run folder (next to the run's ``ledger.jsonl`` and ``results.json``)::

    RUN_DIR/model/weights.pt      the state dict
    RUN_DIR/model/bundle.json     network config, preprocessing, label convention, weights digest, card
    RUN_DIR/model/MODEL_CARD.md   the card for people

The privacy card says what guarantee the weights carry (docs/PRIVACY.md): method, the epsilon the
ledger says was spent and the budget, delta, the neighbouring relation, the accountant, how many
teachers/hospitals, the data source, and the sha256 digest of the ledger it was computed from.
Non-private models carry a card too, saying so.

Loading verifies everything it can from the files alone: the weights' digest, that the card is
complete, that the ledger next to it has the recorded digest and still gives the recorded epsilon, and
``bundle_sha256``, a digest over every other field of bundle.json (network, preprocessing, labels, the
weights' digest, the whole card -- budget, teachers, data source, ``released_with`` -- and the digest of
MODEL_CARD.md's text), so that nothing which changes a prediction or a privacy claim can be edited on its
own. A bundle failing any check is refused with one line (:class:`BundleError`). The digests are not a
signature: they catch edits and corruption, not a forger who recomputes them (that needs a key).

Models released together (the cells of one comparison, trained on the same patients) carry, in their
card's ``released_with``, the combined epsilon of everything released with them, computed from the
hospitals' own ledgers (:func:`attach_release`); loading re-checks it when those ledgers are reachable.

Every card states its own method's trust model (``task.reporting.trust``): who could see what -- a trusted PATE aggregator
every teacher's un-noised encoding, a secure one only masked vectors and a noised sum, pooled training's trainer
every patient, a public floor none --, in the same sentence the comparison report prints for that method; and
that differential privacy protects the patients against everyone who sees what is released. MODEL_CARD.md says it
all in words, with the data, the network, the preprocessing and the test Dice (``task.reporting.model_card``); the card's
fields stay in bundle.json as JSON.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from privacy.errors import PrivacyError
from privacy.ledger import Ledger
from task.data.layouts import CLASSES
from task.data.msd import MODALITIES
from task.errors import UserError
from task.io import atomic_write_bytes, atomic_write_json, atomic_write_text
from task.learning.networks import build_unet_from_config
from task.reporting.model_card import model_card_markdown

BUNDLE_FORMAT = "fedpate-model-bundle"
#: 2: ``bundle_sha256`` covers every field and MODEL_CARD.md (version 1 covered the weights only)
BUNDLE_VERSION = 2
#: the label and channel conventions a bundle states: MSD Task01's codes (task.data.msd), named as every report and
#: command names our classes (task.data.layouts.CLASSES)
MSD_LABELS = {str(code): name for code, name in CLASSES.items()}
MSD_MODALITIES = {str(index): name for index, name in enumerate(MODALITIES)}
CARD_KEYS = ("method", "private", "epsilon", "epsilon_budget", "delta", "relation", "accountant",
             "teachers", "hospitals", "data_source", "ledger_digest")


class BundleError(UserError):
    """A model bundle that is missing, tampered with, or inconsistent with its ledger."""


@dataclass
class LoadedBundle:
    model: Any
    network: dict
    preprocessing: dict
    card: dict
    path: Path


def preprocessing_of(world_or_prepared) -> dict:
    """The preprocessing a model was trained with, as `fedpate predict` must repeat it."""
    prepared = getattr(world_or_prepared, "prepared", None) or world_or_prepared
    config = getattr(prepared, "config", None)
    if config is None:  # no preprocessing record (synthetic arrays): the grid is all there is to repeat
        return {"grid": list(world_or_prepared.grid)}
    config = config.to_dict()
    return {"grid": list(config["grid"]), "config": config}


@dataclass(frozen=True)
class CardGuarantee:
    """The guarantee a privacy card states beside the ledger's ε; recorded only when the ledger holds a record
    (a private model), None otherwise.

    Args:
        delta: the δ at which the ledger's ε is computed (the worst owner's).
        epsilon_budget: the run's budget, recorded beside the ledger's ε.
        relation: the neighbouring relation of the guarantee: only the ledger's events under it are accounted
            (None = all of them, which must then share one relation).
        accountant: the accountant's name, as recorded in the card (it does not choose how ε is computed).
    """

    delta: float | None = None
    epsilon_budget: float | None = None
    relation: str | None = None
    accountant: str | None = None

    def __post_init__(self) -> None:
        if self.delta is not None and not 0 <= float(self.delta) < 1:
            raise ValueError(f"privacy card: delta must be in [0, 1), got {self.delta!r}")
        if self.epsilon_budget is not None and not float(self.epsilon_budget) > 0:
            raise ValueError(f"privacy card: epsilon_budget must be positive, got {self.epsilon_budget!r}")


def privacy_card(*, method: str, ledger_path: str | Path | None, data_source: Mapping[str, Any],
                 guarantee: CardGuarantee = CardGuarantee(), teachers: int | None = None,
                 hospitals: int | None = None, queries: int | None = None,
                 extra: Mapping[str, Any] | None = None) -> dict:
    """Build the card from the run's ledger (the epsilon is always the ledger's, never passed in).

    The model is private when the ledger holds at least one record; ``guarantee`` is recorded only then.

    Args:
        method: the method's name.
        ledger_path: the run's ledger.jsonl (None or missing = an empty ledger: a non-private model).
        data_source: where the training data came from (copied into the card).
        guarantee: δ, the budget, the relation and the accountant (:class:`CardGuarantee`; default: none, for a
            non-private model).
        teachers / hospitals: PATE's teacher count and the number of hospitals (None where not applicable).
        queries: PATE's released queries (None where not applicable).
        extra: further card fields (None = none); they may override the fields above.
    """

    ledger = Ledger(ledger_path) if ledger_path is not None and Path(ledger_path).exists() else Ledger(None)
    private = len(ledger) > 0
    claim = guarantee   # recorded only for a private model
    epsilon = _ledger_epsilon(ledger, claim.delta, claim.relation) if private else None
    return {
        "method": method, "private": private, "epsilon": epsilon,
        "epsilon_budget": claim.epsilon_budget if private else None, "delta": claim.delta if private else None,
        "relation": claim.relation if private else None, "accountant": claim.accountant if private else None,
        "teachers": teachers, "hospitals": hospitals, "queries": queries,
        "data_source": dict(data_source), "ledger_digest": ledger.digest(),
        "ledger_owners": ledger.owners(), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **dict(extra or {}),
    }


def save_bundle(run_dir: str | Path, model, network: Mapping[str, Any], preprocessing: Mapping[str, Any],
                card: Mapping[str, Any]) -> Path:
    """Write weights, bundle.json and MODEL_CARD.md into ``run_dir/model`` (each file atomically)."""

    missing = [key for key in CARD_KEYS if key not in card]
    if missing:
        raise ValueError(f"privacy card is missing {missing}")
    bundle_dir = Path(run_dir) / "model"
    buffer = io.BytesIO()
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, buffer)
    weights = buffer.getvalue()
    atomic_write_bytes(bundle_dir / "weights.pt", weights)
    bundle = {
        "format": BUNDLE_FORMAT, "version": BUNDLE_VERSION,
        "network": dict(network), "preprocessing": dict(preprocessing),
        "labels": MSD_LABELS, "modalities": MSD_MODALITIES,
        "weights_sha256": hashlib.sha256(weights).hexdigest(),
        "card": dict(card),
    }
    seal_bundle(bundle_dir, bundle)
    return bundle_dir


def _plain(value: Any) -> Any:
    """JSON's view of a value (as ``task.io.atomic_write_json`` writes it): what the digest is computed over."""
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def bundle_digest(bundle: Mapping[str, Any]) -> str:
    """sha256 of every field of bundle.json but ``bundle_sha256`` itself, in canonical JSON (sorted keys)."""
    fields = {k: v for k, v in bundle.items() if k != "bundle_sha256"}
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=_plain)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def seal_bundle(bundle_dir: Path, bundle: dict) -> None:
    """Write MODEL_CARD.md (from ``bundle``), then bundle.json with the digest of that text and
    ``bundle_sha256`` over every field (written last: a bundle interrupted between the two is refused)."""
    bundle = json.loads(json.dumps(bundle, default=_plain))   # the values as they will be read back
    bundle.pop("bundle_sha256", None)
    markdown = model_card_markdown(bundle)
    atomic_write_text(bundle_dir / "MODEL_CARD.md", markdown)
    bundle["model_card_sha256"] = hashlib.sha256(markdown.encode("utf-8")).hexdigest()
    bundle["bundle_sha256"] = bundle_digest(bundle)
    atomic_write_json(bundle_dir / "bundle.json", bundle)


def load_bundle(run_dir: str | Path, *, verify_ledger: bool = True) -> LoadedBundle:
    """Load and verify a bundle from a run folder (or its ``model`` subfolder)."""

    run_dir = Path(run_dir)
    bundle_dir = run_dir if (run_dir / "bundle.json").exists() else run_dir / "model"
    bundle_file = bundle_dir / "bundle.json"
    if not bundle_file.is_file():
        raise BundleError(f"--model {run_dir}: no model bundle (expected {bundle_file})")
    try:
        bundle = json.loads(bundle_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BundleError(f"{bundle_file}: not a readable bundle ({exc.__class__.__name__})") from None
    if bundle.get("format") != BUNDLE_FORMAT:
        raise BundleError(f"{bundle_file}: not a fedpate model bundle")
    card = bundle.get("card")
    if not isinstance(card, dict):
        raise BundleError(f"{bundle_file}: the privacy card is missing")
    missing = [key for key in CARD_KEYS if key not in card]
    if missing:
        raise BundleError(f"{bundle_file}: the privacy card is incomplete (missing {', '.join(missing)})")
    weights = _read_matching(bundle_dir / "weights.pt", bundle.get("weights_sha256"), "the weights file is missing",
                             "weights do not match the digest in bundle.json (modified or corrupt)")
    if verify_ledger:
        verify_card_against_ledger(card, bundle_dir.parent / "ledger.jsonl", bundle_file)
        _verify_release(card, bundle_dir.parent, bundle_file)
    verify_bundle_digests(bundle, bundle_dir)
    model = build_unet_from_config(bundle["network"])
    model.load_state_dict(torch.load(io.BytesIO(weights), map_location="cpu", weights_only=True))
    model.eval()
    return LoadedBundle(model=model, network=bundle["network"], preprocessing=bundle["preprocessing"],
                        card=card, path=bundle_dir)


def verify_bundle_digests(bundle: Mapping[str, Any], bundle_dir: Path) -> None:
    """Every field of bundle.json and the text of MODEL_CARD.md are what was written: a field that changes a
    prediction (network, preprocessing) or a privacy claim (budget, teachers, data source, the combined epsilon
    when its ledgers did not travel with the bundle) cannot be edited on its own."""
    bundle_file = bundle_dir / "bundle.json"
    if bundle.get("version") != BUNDLE_VERSION or not bundle.get("bundle_sha256"):
        raise BundleError(f"{bundle_file}: bundle version {bundle.get('version')} without a digest over its fields "
                          f"(expected version {BUNDLE_VERSION}, written by this fedpate); its preprocessing and card "
                          "cannot be verified: train the model again")
    if bundle_digest(bundle) != bundle["bundle_sha256"]:
        raise BundleError(f"{bundle_file}: its fields do not match bundle_sha256 (edited or corrupt)")
    _read_matching(bundle_dir / "MODEL_CARD.md", bundle.get("model_card_sha256"), "the model card is missing",
                   "does not match model_card_sha256 in bundle.json (edited or corrupt)")


def _read_matching(path: Path, sha256: Any, missing: str, mismatch: str) -> bytes:
    """The bytes of a bundle's file, refused (BundleError naming the file) when it is missing or its sha256 is
    not the one bundle.json records."""
    try:
        data = path.read_bytes()
    except OSError:
        raise BundleError(f"{path}: {missing}") from None
    if hashlib.sha256(data).hexdigest() != sha256:
        raise BundleError(f"{path}: {mismatch}")
    return data


def update_card(run_dir: str | Path, fields: Mapping[str, Any]) -> None:
    """Add ``fields`` to a bundle's card, rewrite MODEL_CARD.md and reseal; the weights are untouched. An edited
    bundle is refused (:func:`verify_bundle_digests`) rather than resealed; a bundle written before bundles were
    sealed is left as it is (loading refuses it)."""
    run_dir = Path(run_dir)
    bundle = json.loads((run_dir / "model" / "bundle.json").read_text())
    if bundle.get("version") != BUNDLE_VERSION:
        return
    verify_bundle_digests(bundle, run_dir / "model")   # resealing an edited bundle would launder the edit
    bundle["card"].update(fields)
    seal_bundle(run_dir / "model", bundle)


def attach_release(run_dir: str | Path, release: Mapping[str, Any]) -> None:
    """Record in a bundle's card what it was released together with (a comparison's combined epsilon,
    from the hospitals' own ledgers), through :func:`update_card`."""

    run_dir = Path(run_dir)
    comparison = run_dir
    while comparison != comparison.parent and not (comparison / release["hospital_ledgers"]).exists():
        comparison = comparison.parent
    ledgers = os.path.relpath(comparison / release["hospital_ledgers"], run_dir)
    update_card(run_dir, {"released_with": {**dict(release), "hospital_ledgers": ledgers}})


def _verify_release(card: Mapping[str, Any], run_dir: Path, where: Path) -> None:
    """The combined epsilon a card states must still be what the hospitals' ledgers give (when present)."""

    release = card.get("released_with")
    if not release:
        return
    folder = run_dir / release["hospital_ledgers"]
    if not folder.is_dir():
        return  # the bundle travelled without its comparison: its own ledger was checked above
    combined = {}
    for name, digest in release["hospital_ledger_digests"].items():
        path = folder / name
        ledger = Ledger.load(path) if path.exists() else None
        if ledger is None or ledger.digest() != digest:
            raise BundleError(f"{where}: the card's combined epsilon does not match {path} (ledger changed)")
        combined.update({o: ledger.spent(o, release["delta"]).epsilon for o in ledger.owners()})
    worst = max(combined.values()) if combined else None
    stated = release.get("combined_epsilon")
    if (worst is None) != (stated is None) or (worst is not None and not math.isclose(worst, stated, rel_tol=1e-6)):
        raise BundleError(f"{where}: the card says combined epsilon={stated} but the hospitals' ledgers give {worst}")


def verify_card_against_ledger(card: Mapping[str, Any], ledger_path: Path, where: Path) -> None:
    """The card must describe the ledger beside it: same digest and the same epsilon."""

    if not ledger_path.exists():
        if card["private"]:
            raise BundleError(f"{where}: the card claims a private model but {ledger_path} is missing")
        return
    try:
        ledger = Ledger.load(ledger_path)
    except PrivacyError as exc:
        raise BundleError(f"{ledger_path}: unreadable ledger ({exc})") from None
    if ledger.digest() != card["ledger_digest"]:
        raise BundleError(f"{where}: the card does not match {ledger_path} (ledger digest differs)")
    if bool(card["private"]) != (len(ledger) > 0):
        raise BundleError(f"{where}: the card says private={card['private']} but the ledger has {len(ledger)} releases")
    if card["private"]:
        epsilon = _ledger_epsilon(ledger, card["delta"], card["relation"])
        claimed = card["epsilon"]
        if claimed is None or not math.isclose(float(claimed), epsilon, rel_tol=1e-6, abs_tol=1e-9):
            raise BundleError(f"{where}: the card says epsilon={claimed} but the ledger gives {epsilon:.6g}")


def _ledger_epsilon(ledger, delta, relation) -> float:
    """The guarantee of a model trained on several owners' data: the worst owner's epsilon."""
    return max(ledger.spent(owner, delta, relation=relation).epsilon for owner in ledger.owners())
