"""The hospital's side of DP-FedAvg: one round of local DP-SGD on its own patients.

The privacy accounting is the hospital's (docs/PRIVACY.md, "The ledger"): each hospital runs DP-SGD with Poisson
sampling on its own patients, charged to its own ledger (``workdir/dpfedavg-<run>.jsonl``, owner =
the hospital) through a budget guard *before* each epoch touches data, under the relation the server
asks for (``FedAvgRoundRequest.relation``, default replace-one: the federation treats dataset sizes as public,
and add/remove would not survive publishing them). The hospital does not report its number of
examples: the server's FedAvg weights are public (equal per hospital, ``server.dpfedavg``). The noise
multiplier is calibrated once for the whole federation plan (rounds x local epochs at this hospital's
sampling rate), so the planned rounds spend exactly the budget; a round the budget cannot pay for
trains nothing. The reply carries the ledger records of this round so the server can mirror them: the
server's ε for the global model comes from those mirrored ledgers (the worst hospital).

Replays: the round's release ids carry a nonce this hospital mints, so training a round again is
always charged again; the identical request sent twice (same weights, same configuration) is answered from
the hospital's :class:`clients.replay.AnswerBook` with the identical earlier update, and no noise is drawn.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from privacy.guard import BudgetGuard, GuardChain
from privacy.ledger import Ledger
from privacy.mechanisms import NoiseSource
from clients.replay import AnswerBook, legacy_request_key, mint_nonce, request_key
from task.learning import accounting
from task.learning.compute import Compute
from task.learning.dpsgd import DPConfig, PrivateTraining, steps_per_epoch
from task.errors import UserError
from task.names import check_name_part
from task.learning.networks import build_unet
from task.wire.requests import FedAvgRoundRequest
from task.learning.training import TrainConfig, lever_settings, train_segmentation, trainable_of


@functools.lru_cache(maxsize=64)
def plan_noise_multiplier(epsilon: float, delta: float, plan: tuple, relation: str) -> float:
    """Noise multiplier for a plan of (steps per epoch, epochs) runs composed (cached: every round asks)."""
    return accounting.composed_dpsgd_noise_multiplier(   # and on disk: every run of the same plan asks again
        epsilon, delta, [(1.0 / steps, steps * epochs) for steps, epochs in plan], relation=relation)


def _read_round(hospital, config: FedAvgRoundRequest | Mapping[str, Any]) -> FedAvgRoundRequest:
    """The round ``config`` asks for; a malformed one is refused naming the hospital and the key."""
    try:
        return FedAvgRoundRequest.from_config(config)
    except UserError as exc:
        raise UserError(f"hospital {hospital.hospital_id}: {exc}") from None


def local_dpsgd_round(hospital, weights: Mapping[str, np.ndarray], config: FedAvgRoundRequest | Mapping[str, Any]):
    request = _read_round(hospital, config)
    if request.reproducible_noise and hospital.deployed:   # refused before anything is touched
        raise UserError(f"hospital {hospital.hospital_id}: refuses reproducible (seeded) noise: "
                        "it is for simulations only")
    # the run tag names this run's ledger file: one that is not a plain name part could name another file --
    # the lifetime ledger itself (``x/../privacy-ledger``), or one outside the hospital's folder
    run_tag = check_name_part(request.run_tag, f"hospital {hospital.hospital_id}: the server's run_tag")
    # a genuine retry of this exact request gets the identical update it got before: no new release. The key
    # covers the whole message config as received (the run's settings beside the round's), as it always has
    book = AnswerBook(Path(hospital.workdir) / "answers")
    received = config.to_config() if isinstance(config, FedAvgRoundRequest) else config
    asked = ({f"w.{name}": value for name, value in weights.items()},
             {name: value for name, value in received.items() if name != "world"})
    key = request_key("dp-fedavg-round", *asked)
    answered = book.lookup(key, legacy_request_key("dp-fedavg-round", *asked))
    if answered is not None:
        return answered[0], answered[1]
    round_index, rounds, local_epochs = request.round, request.rounds, request.local_epochs
    epsilon, delta, relation = request.epsilon, request.delta, request.relation
    case_ids = [case for partition in hospital.partitions for case in partition]
    images = hospital.prepared.images(case_ids)
    labels = hospital.prepared.labels(case_ids)

    # the server's setting names the network: a voxel head arrives in the weights when it trains one
    model = build_unet(hospital.preset.unet, trainable=trainable_of(request.levers()))
    model.load_state_dict({name: torch.as_tensor(np.asarray(value)) for name, value in weights.items()})
    batch_size = request.batch_size   # the server's recipe, whole (the request refuses a missing field)
    steps = steps_per_epoch(len(case_ids), batch_size)
    # one sigma for every setting of the server's grid (its plan: expected batch and epochs of each), at this
    # hospital's own sampling rates: all of them together spend this run's budget
    plan = request.plan_entries() or [{"batch_size": batch_size, "epochs": local_epochs * rounds}]
    noise_multiplier = plan_noise_multiplier(
        epsilon, delta, tuple((steps_per_epoch(len(case_ids), int(s["batch_size"])), int(s["epochs"])) for s in plan),
        relation)
    # reproducible noise (simulation only) is named by what the run is, not by its nonce: the same seed and
    # budget repeat the same streams; every round and epoch still draws its own
    noise = (NoiseSource.reproducible(request.seed).child("dp-fedavg", hospital.hospital_id, f"eps-{epsilon:g}")
             if request.reproducible_noise else NoiseSource())
    ledger = Ledger(Path(hospital.workdir) / f"dpfedavg-{run_tag}.jsonl")
    # this run's budget, and the hospital's lifetime budget over everything released from its patients
    guard = GuardChain(BudgetGuard(ledger, epsilon, delta), [(hospital.lifetime_guard(request), [hospital.hospital_id])])
    before = {record["release_id"] for record in ledger.records()}
    setting = f"setting-{request.setting}:" if request.plan else ""
    # the server's run tag and round name the release; the hospital's nonce makes every training its own
    prefix = f"dpfedavg:{run_tag}:{setting}round-{round_index}@{mint_nonce()}"
    dp = DPConfig(mode="fixed", epsilon=epsilon, delta=delta, noise_multiplier=noise_multiplier,
                  max_grad_norm=request.max_grad_norm, per_layer=request.per_layer, release_prefix=prefix,
                  stream_prefix=f"{setting}round-{round_index}", relation=relation)
    # local DP-SGD on the hospital's device (Opacus' per-sample gradients there; the noise is still drawn
    # on the host from the stream above and copied, task.learning.dpsgd)
    device, precision = hospital.compute(request)
    train_config = TrainConfig(epochs=local_epochs, batch_size=batch_size,
                               learning_rate=request.learning_rate,
                               seed=request.seed * 1009 + round_index,
                               description=f"{hospital.hospital_id} round {round_index}",
                               # the server's grid entry may set the fine-tuning levers
                               **lever_settings(request.levers()),
                               compute=Compute(device=device, precision=precision, progress=False))
    result = train_segmentation(model, images, labels, train_config,
                                private=PrivateTraining(dp, guard, owners=(hospital.hospital_id,), noise=noise,
                                                         comparison_figures=False))
    new_records = [record for record in ledger.records() if record["release_id"] not in before]
    spent = ledger.spent(hospital.hospital_id, delta) if len(ledger) else None
    new_weights = {name: value.detach().cpu().numpy() for name, value in result.model.state_dict().items()}
    metrics = {
        "epochs_trained": result.epochs_completed,
        "noise_multiplier": noise_multiplier,
        "sampling_rate": 1.0 / steps,
        "batch_size": batch_size,
        "epsilon": spent.epsilon if spent else 0.0,
        "ledger_records": json.dumps(new_records),
        "stopped_reason": result.stopped_reason or "",
        "device": str(device),
    }
    book.store(key, new_weights, metrics)
    return new_weights, metrics
