"""``public-selftrain``: the public model adapted to the public *unlabelled* query scans, without any label
of them and without any hospital: the public floor (docs/PRIVACY.md, "What limits PATE").

Why a second floor: PATE's student trains on the public query scans (the hospitals' population, unlabelled)
together with the public reference maps. A student that trained on those same scans with the *public
model's own* predictions as labels gained nearly all of what PATE gained over ``public-only``: the
scans alone carry information about the population (its scanners, its lesions' appearance) that costs no
privacy. Whatever a private method gains beyond this floor is what the hospitals taught it.

Pseudo-label self-training, in rounds r = 1..R (each a fixed, stated recipe; nothing chosen on test Dice):

1. the current model (round 1: the public model) predicts soft labels p on every query scan;
2. the soft labels are *sharpened* with temperature T: ``p_c^(1/T) / sum_k p_k^(1/T)``. Principle (stated,
   not tuned): at T = 1 the targets are the model's own output, the minimum of its soft cross-entropy, so
   training on them teaches only what augmentation invariance adds; T < 1 is entropy minimisation (Grandvalet
   & Bengio 2005), the cluster assumption that decision boundaries belong in low-density regions of the
   unlabelled scans. T = 0.5 is MixMatch's default (Berthelot et al. 2019), fixed before any result was seen.
   A confident-voxel mask (FixMatch) is not used: the training loop has no voxel mask, and sharpening is its
   soft counterpart.
3. the model is fine-tuned for the student's epochs on the query scans with these targets *together with*
   the public reference images and their one-hot maps (``server.student.train_student`` with
   ``include_reference``, exactly PATE's student recipe with the public model in the teachers' place), so
   labelled public data keep it from drifting towards its own mistakes.

The round kept is the one with the best Dice on the *public validation* set (another centre's labelled
maps: public data, the only set any choice may look at); the test set is scored once, for that model.

Privacy: reads the public query scans (images only), the public reference images and maps and the public
validation set; no hospital array, no release to charge. Its ledger is empty. No query label is read unless the
reference set is the query set (the ``paper`` preset, Fay et al.): the reference maps are then the query scans'
labels, and the cell's results say so (``sim.runners.selftrain.labels_used``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from server.student import ModelTraining, train_public_model, train_student
from task.learning.compute import Compute
from task.options import PublicStart
from task.settings.presets import SelfTraining
from task.learning.training import evaluate_segmentation, predict_probs

#: MixMatch's sharpening temperature (module docstring: fixed by a stated principle, not tuned) and the rounds of
#: pseudo-labelling (the best on public validation is kept): :class:`task.settings.presets.SelfTraining`'s defaults
DEFAULT_TEMPERATURE = SelfTraining().temperature
DEFAULT_ROUNDS = SelfTraining().rounds


@dataclass
class SelfTrainOutcome:
    model: torch.nn.Module
    chosen_round: int                              # 1-based
    validation_dice: list = field(default_factory=list)   # per round, public validation mean Dice (None: no set)
    temperature: float = DEFAULT_TEMPERATURE
    epochs_per_round: int = 0
    query_scans: int = 0


def sharpen(probs: np.ndarray, temperature: float) -> np.ndarray:
    """Per-voxel ``p^(1/T)`` renormalised over the class axis (axis 1); T = 1 returns ``probs``; T -> 0 the
    one-hot argmax. Computed in log space so that small probabilities raised to a large power do not
    underflow into an all-zero voxel."""
    if not temperature > 0:
        raise ValueError(f"sharpening temperature: expected > 0, got {temperature}")
    probs = np.asarray(probs, dtype=np.float64)
    if temperature == 1.0:
        return probs.astype(np.float32)
    logits = np.log(np.clip(probs, 1e-12, None)) / temperature
    logits -= logits.max(axis=1, keepdims=True)
    sharp = np.exp(logits)
    return (sharp / sharp.sum(axis=1, keepdims=True)).astype(np.float32)


def self_train(world, preset, public_model: torch.nn.Module, training: ModelTraining = ModelTraining(),
               recipe: SelfTraining = SelfTraining(), checkpoint_dir: str | Path | None = None) -> SelfTrainOutcome:
    """Rounds of pseudo-labelling on ``world.query_images`` (module docstring).

    Args:
        world: a :class:`task.world.PublicWorld`; only its public arrays are read (query scans, reference
            data, validation set -- never ``query_labels``, though the reference maps are the query labels where
            the reference set is the query set).
        preset: the preset (network, batch size, learning rate; ``student.epochs`` when ``training.epochs`` is
            None).
        public_model: round 1's labeller and starting point.
        training: round 1's seed (round r trains with ``seed + r - 1``), the fine-tuning epochs per round (None =
            the preset's ``student.epochs``), progress bars, and where the models train and predict
            (its ``compute``); every round trains every weight with the public reference data and releases
            the average of its iterates at the preset's ``student.ema_decay``, as PATE's student does (its other
            fields are not read).
        recipe: the rounds of pseudo-labelling (the one with the best public validation Dice is kept, the
            earliest on ties or without a validation set) and the sharpening temperature T (:func:`sharpen`;
            MixMatch's 0.5 by default) -- :class:`task.settings.presets.SelfTraining`.
        checkpoint_dir: where each round's training is checkpointed (``round-<r>.pt``) and resumed from;
            None = no checkpoints.
    """
    rounds, temperature = int(recipe.rounds), float(recipe.temperature)
    device, precision = training.compute.device, training.compute.precision
    epochs = preset.student.epochs if training.epochs is None else int(training.epochs)
    queries = np.arange(len(world.query_images))
    model = public_model
    candidates: list[tuple[torch.nn.Module, float | None]] = []
    for round_index in range(1, rounds + 1):
        targets = sharpen(predict_probs(model, world.query_images, device=device, precision=precision), temperature)
        init = {k: v.detach().clone() for k, v in model.state_dict().items()}
        checkpoint = Path(checkpoint_dir) / f"round-{round_index}.pt" if checkpoint_dir else None
        round_training = ModelTraining(seed=training.seed + round_index - 1, epochs=epochs, include_reference=True,
                                       checkpoint=checkpoint, compute=training.compute,
                                       ema_decay=preset.student.ema_decay)
        model = train_student(world, targets, queries, preset, round_training, init=init)
        score = None
        if world.validation_images is not None and len(world.validation_images):
            score = evaluate_segmentation(model, world.validation_images, world.validation_labels,
                                          device=device, precision=precision).get("mean")
        candidates.append((model, score))
    # best public validation Dice; the earliest round on ties or without a validation set
    chosen = max(range(len(candidates)), key=lambda i: (-1.0 if candidates[i][1] is None else candidates[i][1], -i))
    return SelfTrainOutcome(model=candidates[chosen][0], chosen_round=chosen + 1,
                            validation_dice=[score for _, score in candidates], temperature=float(temperature),
                            epochs_per_round=epochs, query_scans=len(queries))


@dataclass
class PublicModels:
    """The server's public models: ``reference`` is pre-trained on the public reference maps (its continuation on
    those maps is the ``public-only`` baseline); ``start`` is the model every method starts from (the teachers, the
    PATE student and its anchor, DP-SGD, DP-FedAvg, non-private training): ``reference`` itself, or ``reference``
    self-trained on the public query scans (``selftrain``, its outcome)."""
    reference: torch.nn.Module
    start: torch.nn.Module
    selftrain: SelfTrainOutcome | None = None


def selftrain_settings(preset) -> tuple[int, float]:
    """(rounds, temperature) of the preset's self-training (:class:`task.settings.presets.SelfTraining`)."""
    return int(preset.self_training.rounds), float(preset.self_training.temperature)


def selftrain_checkpoints(checkpoint: str | Path | None) -> Path | None:
    """Where the self-training that follows the public model at ``checkpoint`` keeps its rounds: a folder beside
    it (``public-model.pt`` -> ``public-model-selftrain/``), shared by the start model and the
    ``public-selftrain`` baseline so that a comparison trains it once."""
    if checkpoint is None:
        return None
    checkpoint = Path(checkpoint)
    return checkpoint.with_name(checkpoint.stem + "-selftrain")


def train_public_models(world, preset, *, seed: int = 0, checkpoint: str | Path | None = None,
                        compute: Compute = Compute(progress=False)) -> PublicModels:
    """The public model and the start every method shares, as the preset's ``public_start`` says.

    ``reference`` (:class:`task.settings.presets.PublicStart`): the public model trained on the public reference maps.
    ``self-trained``: that model then self-trained on the public query scans (:func:`self_train`): everything
    public the server holds, with no hospital and no privacy cost. Principle: a private method should add what the
    hospitals know to the strongest model the public data give, not to a weaker one (a gain over a weak start can
    be what the public scans alone would have given: Xie et al. 2020, "Self-training with Noisy Student improves
    ImageNet classification", arXiv 1911.04252; Lee 2013, pseudo-labels).

    Args:
        world: the server's :class:`task.world.PublicWorld` (reference maps; query scans and the validation set
            for self-training; never the query scans' labels).
        preset: the preset (``public_start``, the network, the epochs; ``self_training``).
        seed: the trainings' seed.
        checkpoint: the public model's checkpoint (``public-model.pt``); the self-training's rounds are kept in
            the folder :func:`selftrain_checkpoints` names. Both are resumed from. None = no checkpoints.
        compute: where the models train (``device``: ``task.learning.device``; auto = CUDA when there is one), whether
            forward passes run under bf16 autocast (``precision``) and progress bars (``progress``; off by default).
    """
    training = ModelTraining(seed=seed, compute=compute)
    reference = train_public_model(world, preset, replace(training, checkpoint=checkpoint))
    if preset.public_start is PublicStart.REFERENCE:
        return PublicModels(reference=reference, start=reference)
    rounds, temperature = selftrain_settings(preset)
    outcome = self_train(world, preset, reference, training, SelfTraining(rounds=rounds, temperature=temperature),
                         checkpoint_dir=selftrain_checkpoints(checkpoint))
    return PublicModels(reference=reference, start=outcome.model, selftrain=outcome)


def start_description(preset) -> str:
    """What the start model every method shares is, in words, for results and model cards."""
    if preset.public_start is PublicStart.SELF_TRAINED:
        return ("the start model: the public model pre-trained on the public reference set, then self-trained on "
                "the public query scans (no hospital), as PATE's teachers and student")
    return "the public model (pre-trained on the public reference set, as PATE's teachers and student)"
