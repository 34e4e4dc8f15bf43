"""Who could see what: each method's trust model, stated the same way in its model card and in the report.

Every producer of a run records, in its results, how its training data was aggregated (``aggregation``:
``trusted``, ``secure``, ``pooled`` or ``none``) and what each party could see (``who_sees_what``: party ->
what it saw), because that differs per method: a trusted PATE aggregator sees every teacher's un-noised
encoding, a secure one only masked vectors and a noised sum, pooled DP-SGD's trainer holds every patient, a
public floor touches no patient. :func:`task.reporting.results.write_run` copies both into the model card, and
:func:`trust_line` is the one sentence the card (``task.reporting.model_card.model_card_markdown``) and the comparison report
(``sim.report.who_sees_what_lines``) both print. The secure and trusted PATE texts are written where their
protocol is (``server.pate_secure.who_sees_what``, ``server.dpfedavg_secure.who_sees_what``); the others here.
"""

from __future__ import annotations

from typing import Any, Mapping

#: what differential privacy protects, whatever the method (the card's and the report's closing sentence)
PROTECTS = ("differential privacy protects the patients against everyone who sees what a private method releases: "
            "its model, its pseudo-labels where it has them, and the Dice of that model on the test patients (a "
            "post-processing of the model)")


def pooled(private: bool) -> dict[str, str]:
    """Training on the pooled patients (``dp-sgd-central``, ``nonprivate-central``): one trainer holds them all."""
    return {"trainer": "every hospital's patients, pooled and un-noised (trusted with all of them: the simulation's "
                       "yardstick of one party holding every scan)",
            "hospitals": "their own patients, handed to the trainer",
            "results": ("the model, trained with DP-SGD (per-patient clipped, noised gradients)" if private else
                        "the model, trained without noise: no guarantee, it may memorise its patients")}


def public_only(what: str = "the public reference data") -> dict[str, str]:
    """A public floor (``public-only``, ``public-selftrain``): no hospital's patient is used."""
    return {"trainer": f"{what} only; no hospital's patient", "hospitals": "nothing: they are not asked",
            "results": "the model, trained on public data only"}


def federated_averaging() -> dict[str, str]:
    """DP-FedAvg with a trusted aggregator: each hospital noises its own update."""
    return {"aggregator": "each hospital's model update of every round, after the hospital's own DP-SGD (clipped "
                          "and noised at the hospital; the aggregator adds no noise)",
            "hospitals": "their own patients and each round's global model",
            "results": "the global model"}


def trust_line(method: str, aggregation: str | None, parties: Mapping[str, Any] | None) -> str:
    """One sentence: who could see what in ``method`` (aggregation ``aggregation``); an old bundle or result that
    recorded neither says so."""
    if not parties:
        return f"Who could see what in `{method}`: not recorded for this model."
    said = "; ".join(f"{party}: {what}" for party, what in parties.items())
    return f"Who could see what in `{method}` (aggregation: **{aggregation or 'not recorded'}**): {said}."
