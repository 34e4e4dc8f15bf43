"""How the aggregator's protocols talk to the hospitals: everything PATE (server/pate.py) and DP-FedAvg
(server/dpfedavg.py) call, declared once. Framework-free.

Implementations: :class:`server.flower_transport.FlowerTransport` (Flower messages over a ``Grid``: the
ServerApp, simulated or deployed) and ``sim.runners.inprocess.InProcessTransport`` (hospitals as objects in
this process). A hospital that does not answer is simply absent from a reply; once dropped it does not
come back, and the protocol decides what that means for sensitivity and the ledger.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from task.errors import UserError


class HospitalTransport(Protocol):
    """The hospitals as the protocols see them."""

    #: hospital id -> whether it runs on its own machine with its own patients (it then refuses everything
    #: meant for simulations only: un-noised diagnostics, seeded noise)
    deployed: Mapping[str, bool]
    #: hospital id -> why it left (timed out, error reply, refusal); it is not asked again
    dropped: Mapping[str, str]
    #: per query round: hospital id -> encoding bytes one teacher uploaded for one scan (measured)
    bytes_up: Sequence[Mapping[str, float]]
    #: per query round: hospital id -> what it said about its answer (counts only, e.g. fallback_teachers)
    notes: Sequence[Mapping[str, Mapping[str, Any]]]

    def hospital_ids(self) -> list[str]:
        """The hospitals still connected, sorted."""

    def train(self, config: Mapping[str, Any], init_weights: Mapping[str, np.ndarray] | None = None
              ) -> dict[str, dict]:
        """Train every hospital's teachers from ``init_weights``; per hospital: metrics (incl. "teachers")
        and its local epsilon."""

    def query(self, scans: np.ndarray, codec: Mapping[str, np.ndarray], config: Mapping[str, Any]
              ) -> dict[str, np.ndarray]:
        """Per responding hospital: (T_h, n, l) encodings of the public ``scans``. ``config`` declares what
        is released (release ids, sigma, K); ``config["diagnostic"]`` asks for an un-noised answer."""

    def evaluate(self, config: Mapping[str, Any], test: Mapping[str, np.ndarray] | None = None
                 ) -> dict[str, dict]:
        """Per hospital: {"teacher_dice": [...], "teacher_dice_mean": ...} on the public test arrays sent."""

    def fedavg_round(self, weights: Mapping[str, np.ndarray], config: Mapping[str, Any]
                     ) -> dict[str, tuple[dict, dict]]:
        """One DP-FedAvg round of local DP-SGD from ``weights``: {hospital: (metrics, new local weights)}."""

    def secure_stage(self, stage: str, messages: Mapping[str, Mapping[str, Any]], config: Mapping[str, Any]
                     ) -> dict[str, dict]:
        """One stage of a secure sum (``server/secure.py``): each named hospital's reply to its message; a
        hospital that refuses or does not answer is absent (it dropped out of that sum)."""


@runtime_checkable
class TeacherEnsembleDiagnostics(Protocol):
    """Optional, simulation only: the teachers' averaged full-resolution probabilities on some scans (the
    noise-free ceiling PATE can reach). Those probabilities never travel over the wire, so only a
    transport that holds the hospitals in this process offers it; no guarantee covers it."""

    def ensemble_probabilities(self, scans: np.ndarray, config: Mapping[str, Any] | None = None) -> np.ndarray:
        """(n, C, *grid) mean of every teacher's softmax output."""


def measured_bytes_per_teacher(rounds: Sequence[Mapping[str, float]]) -> float | None:
    """Mean encoding bytes one teacher uploaded for one scan over ``rounds`` (``HospitalTransport.bytes_up``)."""
    sizes = [size for round_bytes in rounds for size in round_bytes.values()]
    return None if not sizes else float(sum(sizes) / len(sizes))


#: what a published results.json may say about why a hospital left (the full reason stays in the server log)
DROPOUT_REASONS = ("refused: privacy budget", "refused: request", "no reply", "error reply", "malformed reply")


def public_dropout_reason(why: str) -> str:
    """The category of a dropout reason, for published results: a hospital's refusal text can carry numbers
    that depend on its other runs; only which kind of dropout it was is published."""
    text = str(why)
    if text.startswith("refused: privacy budget"):
        return DROPOUT_REASONS[0]
    if text.startswith("refused") or text.startswith("codec-missing"):
        return DROPOUT_REASONS[1]
    for reason in DROPOUT_REASONS[2:]:
        if text.startswith(reason):
            return reason
    return "no reply"


def fallback_counts(notes: Sequence[Mapping[str, Mapping[str, Any]]]) -> dict[str, int]:
    """How many teacher answers each hospital replaced by its fixed fallback row (counts only)."""
    totals: dict[str, int] = {}
    for round_notes in notes:
        for hospital, note in round_notes.items():
            totals[hospital] = totals.get(hospital, 0) + int(note.get("fallback_teachers", 0) or 0)
    return totals


def fresh_run_folder(out_dir) -> Path:
    """An earlier run released from these patients: running again into its folder would be a second
    release that a fresh ledger would hide (its releases stay counted in the hospitals' own ledgers)."""
    out = Path(out_dir)
    ledger_path = out / "ledger.jsonl"
    if ledger_path.exists() and ledger_path.stat().st_size > 0:
        raise UserError(f"--out {out}: already holds {ledger_path.name} from an earlier run; use a new folder")
    out.mkdir(parents=True, exist_ok=True)
    return out
