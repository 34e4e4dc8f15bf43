"""The one segmentation training loop: teachers, students, public pre-training and the baselines.

Loss (``task.learning.losses.per_sample_loss``; per sample, so Opacus' per-sample clipping stays valid: a batch-coupled
loss would break it):
``L_i = Dice_i + CE_i`` where ``Dice_i`` is MONAI's soft Dice loss over the four classes of sample i
(``DiceLoss(softmax=True, batch=False)``) and ``CE_i`` the voxel-mean cross-entropy of sample i; the batch
loss is the mean of the ``L_i``. This is MONAI's ``DiceCELoss`` with ``batch=False``, written out because
``DiceCELoss`` cannot return per-sample values. Targets are hard int labels (n, *g) or soft probability
maps (n, C, *g) -- students learn from decoded teacher outputs (Fay et al.,
Alg. 1 line "train student on (x_n, y_hat_n)"); for soft targets both terms use the probabilities
directly (soft Dice, soft-target CE).

Adam, seeded batch order (``torch.Generator``), optional augmentation (``task.data.augment``), tqdm
progress, an atomic checkpoint after every epoch and resume (model, optimizer, epoch, RNG states, DP
session: sigmas charged so far). DP-SGD is switched on by passing a ``task.learning.dpsgd.PrivateTraining`` (its
``DPConfig``, budget guard, ledger owners and noise source); its batches and noise then come from that noise
source (a ``privacy.mechanisms.NoiseSource``, secure by default), never from the training seed. As Opacus'
``PrivacyEngine.make_private`` wraps model, optimiser and data loader once and leaves the loop alone, plain and
DP-SGD training are two strategies (``_PlainTraining``, ``_DPSGDTraining``) chosen once before the one loop.

Device and precision (``task.learning.device``): ``TrainConfig.compute.device`` (auto | cpu | cuda | cuda:N, default
auto) holds the model, the optimiser state and the dataset tensors -- moved there once per training call, not
once per batch. Augmentation (MONAI, numpy RNG) runs on the host; with ``prefetch`` (default: on when the
device is a GPU) a background thread indexes, augments and copies batch i+1 while the device computes step i,
calling the augmenter in exactly the same order, so the trained weights do not change
(``tests/test_device.py``). Prefetching hides host augmentation only up to one step's time, and a GPU step is
far shorter than augmenting a batch on the host, so on a GPU augmentation runs on the device by default
(``augment_on``: :class:`task.data.augment.BatchAugmentation`, the whole batch at once, dataset on the
device). DP-SGD batches are not prefetched: batch i+1 is drawn from the epoch's noise stream after step i's
noise, and reproducible streams must keep that order. ``TrainConfig.compute.precision="bf16"`` runs the
forward pass under ``torch.autocast(bfloat16)``; the loss is computed on float32 logits.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from task.data.augment import batch_augmentation, training_augmentation
from task.learning.compute import Compute
from task.learning.device import autocast, model_device, resolve_device
from task.learning.dpsgd import DPSession, PrivateTraining
from task.errors import UserError
from task.options import check_averaging_decay
from task.learning.headgrad import check_frozen_deterministic, check_unet_deterministic
from task.learning.inference import mirrored_probabilities
from task.learning.losses import per_sample_loss
from task.learning.phases import timed
from task.io import atomic_save_torch
from task.learning.networks import VOXEL_HEAD, VoxelHeadUNet, freeze_all_but, load_start_weights
from task.learning.metrics import DiceAccumulator
from task.options import AugmentOn, Precision, Trainable, look_up_option


@dataclass
class TrainConfig:
    epochs: int
    batch_size: int
    learning_rate: float
    seed: int = 0
    augment: bool | str = True             # True = "domain" (flips, rotations, intensity randomisation),
                                           # "geometric" (flips, rotations only) or False
    checkpoint: str | Path | None = None   # saved after every epoch; resumed from when it exists
    init_from: Any = None                  # path to a checkpoint / state_dict to start from (e.g. public pre-training)
    weight_decay: float = 0.0
    description: str = "train"
    extra_checkpoint: dict = field(default_factory=dict)  # stored with the checkpoint (e.g. network_config)
    loss_fn: Callable | None = None        # (outputs, targets) -> per-sample losses (n,); None = per_sample_loss
    optimizer_factory: Callable | None = None  # parameters -> optimizer; None = Adam(learning_rate, weight_decay)
    #: where it trains (auto | cpu | cuda | cuda:N; a torch.device is kept as its spec), "32" | "bf16" autocast
    #: around the forward pass (task.learning.device), and the progress bar
    compute: Compute = Compute()
    #: augment the next batch in a background thread while this one trains (None: only on a GPU, where the
    #: host would otherwise starve it; on a shared CPU both compete for the same cores)
    prefetch: bool | None = None
    #: where augmentation runs: "host" (MONAI, per sample; the CPU default and the reference results) or "device"
    #: (task.data.augment.BatchAugmentation: the whole batch in torch on the training device; same transforms and
    #: ranges, other draws). None: "device" on a GPU, "host" otherwise
    augment_on: AugmentOn | str | None = None
    #: private fine-tuning levers (task.learning.networks.TRAINABLE_SETS for the sets and why they exist)
    trainable: str = Trainable.ALL.value   # which parameters are trained (the rest keep their start values)
    augmentation_multiplicity: int = 1     # DP-SGD: k augmented views per patient, averaged before clipping
    ema_decay: float | None = None         # the returned model is the exponential moving average of the iterates


#: the private fine-tuning levers a settings-grid entry (``dpsgd_grid``, ``dpfedavg_grid``) may set, with their
#: types; an entry that does not name one keeps TrainConfig's default
LEVER_KEYS = {"trainable": str, "augmentation_multiplicity": int, "ema_decay": float}


def trainable_of(entry) -> str:
    """The trainable set a settings-grid entry or a round's config names (``task.learning.networks.TRAINABLE_SETS``;
    "all" when it names none): which network to build for it, and what to train."""
    return str(entry.get("trainable") or Trainable.ALL)


def lever_settings(entry: dict) -> dict:
    """The lever keys of a settings-grid entry, typed (``ema_decay: None`` stays None)."""
    return {key: (None if entry[key] is None else kind(entry[key])) for key, kind in LEVER_KEYS.items()
            if key in entry}


@dataclass
class TrainResult:
    model: torch.nn.Module
    history: list[dict]
    epsilon: float | None = None
    delta: float | None = None
    accountant: str | None = None
    relation: str | None = None
    epsilon_rdp: float | None = None
    epsilon_add_remove: float | None = None   # the same mechanism's epsilon under each relation (None: undefined)
    epsilon_replace_one: float | None = None
    adaptive: bool = False                    # sigma chosen from earlier outputs: accounted by a privacy filter
    epochs_completed: int = 0
    sigmas: list[float] = field(default_factory=list)
    sampling_rate: float | None = None
    steps_per_epoch: int | None = None
    stopped_reason: str | None = None
    wall_seconds: float = 0.0
    resumed_from_epoch: int | None = None


# -------------------------------------------------------------------------------------------- augmentation
def _augmenter(seed: int, level: bool | str = True, batched: bool = False) -> Callable:
    level = "domain" if level is True else str(level)
    return batch_augmentation(seed, level=level) if batched else training_augmentation(seed, level=level)


def _augment_batch(aug: Callable, images: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Augment each sample on the host (MONAI transforms, the augmenter's own numpy RNG, in batch order)."""
    out_images, out_targets = [], []
    for image, target in zip(images, targets):
        a_img, a_tgt = aug(image, target)
        out_images.append(torch.as_tensor(np.asarray(a_img), dtype=images.dtype))
        out_targets.append(torch.as_tensor(np.asarray(a_tgt), dtype=targets.dtype))
    return torch.stack(out_images), torch.stack(out_targets)


def _device_batches(batches, x_all: torch.Tensor, y_all: torch.Tensor, aug: Callable | None, device,
                    prefetch: bool, batched: bool = False):
    """Yield ``(indices, images, targets)`` on ``device`` for each batch of indices (empty batches: Nones).

    Without augmentation ``x_all``/``y_all`` already live on the device and a batch is one indexing op. With it,
    they stay on the host, each batch is augmented there and copied over (pinned, non-blocking on a GPU). With
    ``prefetch`` one worker thread prepares batch i+1 while the caller trains on batch i: the augmenter is still
    called batch after batch in the same order, so the result is the same as without prefetching. ``batches``
    must not draw from anything the training step also draws from (DP-SGD's noise stream): it is advanced one
    batch ahead. ``batched``: ``aug`` is a :class:`task.data.augment.BatchAugmentation` applied to the whole batch
    where the data already are (the device).
    """

    def prepare(batch):
        if len(batch) == 0:
            return batch, None, None
        index = batch if batch.device == x_all.device else batch.to(x_all.device)
        xb, yb = x_all[index], y_all[index]
        if aug is not None and batched:
            xb, yb = aug(xb, yb)
        elif aug is not None:
            xb, yb = _augment_batch(aug, xb, yb)
            if device.type == "cuda":
                xb, yb = xb.pin_memory(), yb.pin_memory()
        return batch, xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)

    if not prefetch:
        for batch in batches:
            yield prepare(batch)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedpate-prefetch") as pool:
        pending = None
        for batch in batches:
            future = pool.submit(prepare, batch)
            if pending is not None:
                yield pending.result()
            pending = future
        if pending is not None:
            yield pending.result()


# ----------------------------------------------------------------------------------------------- training
def _as_tensor(x: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x))
    return t.to(dtype) if dtype is not None else t


def _load_init(model: torch.nn.Module, init_from: Any) -> None:
    if isinstance(init_from, torch.nn.Module):
        state = init_from.state_dict()
    elif isinstance(init_from, dict):
        state = init_from.get("model", init_from)
    else:
        path = Path(init_from)
        if not path.exists():
            raise UserError(f"init_from: {path} does not exist")
        loaded = torch.load(path, map_location="cpu", weights_only=False)
        state = loaded.get("model", loaded) if isinstance(loaded, dict) else loaded
    load_start_weights(model, state)   # a bare U-Net's weights may start one with a voxel head


def _training_tensors(images: Any, targets: Any, config: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The training set as tensors (float32 images; float32 soft or int64 hard targets), checked against
    ``config``'s epochs and batch size."""
    x_all = _as_tensor(images, torch.float32)
    y_all = _as_tensor(targets)
    y_all = y_all.to(torch.float32) if y_all.is_floating_point() else y_all.long()
    n = len(x_all)
    if n == 0:
        raise UserError("training: no training volumes")
    if len(y_all) != n:
        raise UserError(f"training: {n} images but {len(y_all)} targets")
    if config.epochs < 0 or config.batch_size < 1:
        raise UserError("training: epochs must be >= 0 and batch_size >= 1")
    return x_all, y_all


def _load_start(model: torch.nn.Module, config: TrainConfig, checkpoint: Path | None) -> dict | None:
    """Start ``model`` from ``checkpoint`` when it exists (returning its state, to resume from), else from
    ``config.init_from`` when given (returning None)."""
    if checkpoint is not None and checkpoint.exists():
        resume_state = torch.load(checkpoint, map_location="cpu", weights_only=False)
        model.load_state_dict(resume_state["model"])
        return resume_state
    if config.init_from is not None:
        _load_init(model, config.init_from)
    return None


def _augmentation_placement(config: TrainConfig, device: torch.device) -> tuple[bool, bool]:
    """(``batched``: augment whole batches on the device, ``prefetch``: prepare batch i+1 in a thread while step
    i runs) for ``config`` on ``device`` (a GPU: device augmentation and prefetching unless set otherwise)."""
    on_gpu = device.type == "cuda"
    augment_on = look_up_option(config.augment_on or (AugmentOn.DEVICE if on_gpu else AugmentOn.HOST), AugmentOn,
                                "augment_on")
    prefetch = on_gpu if config.prefetch is None else bool(config.prefetch)
    return bool(config.augment) and augment_on is AugmentOn.DEVICE, prefetch


def _check_levers(config: TrainConfig, private: PrivateTraining | None) -> None:
    """Refuse augmentation multiplicity without DP-SGD and augmentation, and an EMA decay outside [0, 1)."""
    views = int(config.augmentation_multiplicity)
    if views < 1 or (views > 1 and (private is None or not config.augment)):
        raise UserError(f"augmentation_multiplicity: expected 1, or k > 1 with DP-SGD and augmentation, got {views}")
    check_averaging_decay(config.ema_decay, "ema_decay")


class _TrainingSteps(Protocol):
    """What differs between plain and DP-SGD training (:class:`_PlainTraining`, :class:`_DPSGDTraining`), chosen
    once before :func:`train_segmentation`'s loop, as Opacus' ``PrivacyEngine.make_private`` wraps model,
    optimiser and data loader once and leaves the training loop alone."""

    model: torch.nn.Module            # what the loop calls (Opacus' GradSampleModule under DP-SGD)
    optimizer: torch.optim.Optimizer  # what the loop steps (Opacus' DPOptimizer under DP-SGD)
    prefetch_safe: bool               # may batch i+1 be prepared while step i runs

    def begin_epoch(self, epoch: int) -> bool:
        """Start epoch ``epoch`` (0-based); False: stop training before the epoch touches any data."""

    def batches(self, epoch: int) -> Iterator[torch.Tensor]:
        """The epoch's batches of record indices, none empty, drawn lazily one after the other."""

    def after_backward(self) -> None:
        """Between a batch's ``loss.backward()`` and its optimiser step."""

    def after_step(self, loss: torch.Tensor, samples: int) -> None:
        """After the optimiser step on ``samples`` index rows whose mean loss was ``loss``."""

    def epoch_record(self, epoch: int) -> dict[str, Any]:
        """The epoch's history entry (the validation Dice is added to it afterwards)."""

    def observe_validation(self, score: float | None) -> None:
        """The public validation Dice after the epoch (None: undefined)."""

    def state_dict(self) -> dict | None:
        """What a checkpoint stores under ``"dp"``."""

    def config_dict(self) -> dict | None:
        """What a checkpoint stores under ``"dp_config"``."""

    def load_state_dict(self, state: dict | None, checkpoint: Path) -> None:
        """Resume from a checkpoint's ``"dp"`` entry (None: it has none)."""

    def finish(self, result: TrainResult) -> None:
        """After the last epoch: a plain module again, and what ``result`` reports beyond the history."""


class _PlainTraining:
    """Non-private training (:class:`_TrainingSteps`): shuffled batches from the training seed, the mean training
    loss logged per epoch."""

    prefetch_safe = True

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, generator: torch.Generator,
                 n: int, batch_size: int) -> None:
        self.model, self.optimizer, self.generator = model, optimizer, generator
        self.n, self.batch_size = n, batch_size
        self._losses: list[float] = []
        self._seen = 0

    def begin_epoch(self, epoch: int) -> bool:
        self._losses, self._seen = [], 0
        return True

    def batches(self, epoch: int) -> Iterator[torch.Tensor]:
        order = torch.randperm(self.n, generator=self.generator)
        return (order[i:i + self.batch_size] for i in range(0, self.n, self.batch_size))

    def after_backward(self) -> None:
        pass

    def after_step(self, loss: torch.Tensor, samples: int) -> None:
        self._losses.append(float(loss.detach()) * samples)
        self._seen += samples

    def epoch_record(self, epoch: int) -> dict[str, Any]:
        return {"epoch": epoch + 1, "loss": (sum(self._losses) / self._seen) if self._seen else None,
                "samples": self._seen}

    def observe_validation(self, score: float | None) -> None:
        pass

    def state_dict(self) -> None:
        return None

    def config_dict(self) -> None:
        return None

    def load_state_dict(self, state: dict | None, checkpoint: Path) -> None:
        pass   # a DP-SGD checkpoint's privacy state means nothing to plain training

    def finish(self, result: TrainResult) -> None:
        pass


class _DPSGDTraining:
    """DP-SGD training (:class:`_TrainingSteps`) through :class:`task.learning.dpsgd.DPSession`: Opacus-wrapped model and
    optimiser, the ledger, the noise stream.

    Its order of operations is the privacy argument's: ``begin_epoch`` charges the epoch to the ledger before
    the epoch's streams are opened; the batches come from their stream one at a time, and the noise from its
    own (drawn a step ahead on a thread, ``task.learning.dpsgd.StepNoise``); batches are not prefetched, so an empty
    Poisson batch takes its noise-only step where it falls, after the step before it; the loss and the batch
    sizes are never recorded, only sigma and the ledger's epsilon."""

    prefetch_safe = False

    def __init__(self, session: DPSession, views: int, precision: Precision) -> None:
        self.session, self.views, self.precision = session, int(views), precision
        self.model, self.optimizer = session.model, session.optimizer

    def begin_epoch(self, epoch: int) -> bool:
        return self.session.begin_epoch(epoch)

    def batches(self, epoch: int) -> Iterator[torch.Tensor]:
        for batch in self.session.batches():
            if len(batch) == 0:   # the sampled-Gaussian analysis assumes a noisy step here too
                self.session.noise_only_step()
                continue
            # k views of every sampled patient, side by side: augmented independently, averaged per patient
            # before clipping (DPSession.average_views)
            yield batch.repeat_interleave(self.views) if self.views > 1 else batch

    def after_backward(self) -> None:
        if self.precision is not Precision.FP32:
            self.session.per_sample_gradients_to_float32()
        if self.views > 1:
            self.session.average_views(self.views)

    def after_step(self, loss: torch.Tensor, samples: int) -> None:
        pass   # the loss (unbounded sensitivity) and the batch size (the sampling's secret) stay unrecorded

    def epoch_record(self, epoch: int) -> dict[str, Any]:
        # DP-SGD releases only the noisy model: the training loss and the Poisson batch sizes (the secret
        # randomness the amplification relies on) are never recorded, printed or checkpointed
        # the ledger's epsilon; none on the epochs of a verified plan short of its end (composing it every epoch
        # is what the plan saves: DPSession.epoch_epsilon)
        epsilon = self.session.epoch_epsilon()
        return {"epoch": epoch + 1, "noise_multiplier": self.session.sigmas[-1],
                **({} if epsilon is None else {"epsilon": epsilon})}

    def observe_validation(self, score: float | None) -> None:
        self.session.observe_validation(score if score is not None else 0.0)

    def state_dict(self) -> dict:
        return self.session.state_dict()

    def config_dict(self) -> dict:
        return self.session.dp.to_dict()

    def load_state_dict(self, state: dict | None, checkpoint: Path) -> None:
        if state is None:
            raise UserError(f"checkpoint {checkpoint}: was written without DP-SGD; cannot resume with it")
        self.session.load_state_dict(state)

    def finish(self, result: TrainResult) -> None:
        self.session.end_epoch()
        _unwrap(self.model)
        spent = self.session.spent(with_rdp=self.session.comparison_figures)
        for figure in ("epsilon", "delta", "accountant", "relation", "epsilon_rdp", "epsilon_add_remove",
                       "epsilon_replace_one", "adaptive"):
            setattr(result, figure, spent[figure])
        result.sigmas = list(self.session.sigmas)
        result.sampling_rate, result.steps_per_epoch = self.session.sampling_rate, self.session.steps
        result.stopped_reason = self.session.stopped_reason


def _resume(state: dict, optimizer: torch.optim.Optimizer, generator: torch.Generator, steps, ema,
            checkpoint: Path) -> tuple[list[dict], int]:
    """Restore the optimiser (the one Opacus wraps, under DP-SGD), the RNGs, the strategy's state and the EMA
    from a checkpoint's ``state``; returns (history, epochs done)."""
    optimizer.load_state_dict(state["optimizer"])
    generator.set_state(state["generator"])
    torch.set_rng_state(state["torch_rng"])
    history, start_epoch = list(state["history"]), int(state["epoch"])
    steps.load_state_dict(state.get("dp"), checkpoint)
    if ema is not None and state.get("ema") is not None:
        ema.load_state_dict(state["ema"])
    return history, start_epoch


@timed("training", default=True)
def train_segmentation(model: torch.nn.Module, images: Any, targets: Any, config: TrainConfig,
                       private: PrivateTraining | None = None,
                       validation: tuple[Any, Any] | None = None) -> TrainResult:
    """Train ``model`` on ``images`` (n, 4, *g) float and ``targets`` (int labels or soft probabilities).

    Returns the trained (unwrapped) model and a history with one dict per epoch.

    Args:
        model: the network, trained in place (resumed from ``config.checkpoint`` when it exists, else started
            from ``config.init_from`` when given).
        images: (n, 4, *g) float training volumes.
        targets: (n, *g) int labels or (n, C, *g) soft probabilities.
        config: the training settings (:class:`TrainConfig`: epochs, batch, optimiser, device, levers, ...).
        private: a :class:`task.learning.dpsgd.PrivateTraining` (its ``DPConfig``, budget guard, ledger owners and
            noise source) switches on DP-SGD (None = plain training; ``task.learning.dpsgd.private_training``).
        validation: public (images, labels), used by the validation-based noise schedule and logged each epoch
            (None = none).
    """
    started = time.perf_counter()
    x_all, y_all = _training_tensors(images, targets, config)
    device = resolve_device(config.compute.device)
    precision = config.compute.precision
    base_model = model
    checkpoint = Path(config.checkpoint) if config.checkpoint else None
    resume_state = _load_start(base_model, config, checkpoint)
    # model (hence the optimiser's state and Opacus' per-sample gradients) on the device before anything wraps it
    base_model.to(device)
    batched, prefetch = _augmentation_placement(config, device)
    # the dataset on the device once (host-augmented batches are made on the host and copied per batch instead)
    if not config.augment or batched:
        x_all, y_all = x_all.to(device), y_all.to(device)
    _check_levers(config, private)
    # only the trainable set gets gradients, hence DP-SGD's clipping and noise (task.learning.networks.freeze_all_but)
    freeze_all_but(base_model, config.trainable)
    trained = [p for p in base_model.parameters() if p.requires_grad]

    torch.manual_seed(config.seed)
    optimizer = (config.optimizer_factory(trained) if config.optimizer_factory is not None else
                 torch.optim.Adam(trained, lr=config.learning_rate, weight_decay=config.weight_decay))
    ema = _ParameterAverage(base_model, config.ema_decay) if config.ema_decay is not None else None
    generator = torch.Generator().manual_seed(int(config.seed))
    # plain or DP-SGD, chosen once: the loop below is the same for both
    steps: _TrainingSteps
    if private is None:
        steps = _PlainTraining(base_model, optimizer, generator, len(x_all), config.batch_size)
    else:
        steps = _DPSGDTraining(DPSession(base_model, optimizer, private, n=len(x_all), batch_size=config.batch_size,
                                         epochs=config.epochs, has_validation=validation is not None),
                               config.augmentation_multiplicity, precision)
    history, start_epoch = [], 0   # per-epoch records; the epoch a resumed run starts at
    if resume_state is not None:
        history, start_epoch = _resume(resume_state, optimizer, generator, steps, ema, checkpoint)

    bar = tqdm(range(start_epoch, config.epochs), desc=config.description, disable=not config.compute.progress,
               initial=start_epoch, total=config.epochs, leave=False)
    with _frozen_unet_memo(base_model, config, private) as frozen:
        for epoch in bar:
            if not steps.begin_epoch(epoch):
                break  # budget spent (fixed / schedule modes); nothing of this epoch touched the data
            steps.model.train()
            aug = _augmenter(config.seed * 100_003 + epoch, config.augment, batched) if config.augment else None
            for batch, xb, yb in _device_batches(steps.batches(epoch), x_all, y_all, aug, device,
                                                 prefetch and steps.prefetch_safe, batched):
                steps.optimizer.zero_grad(set_to_none=True)
                with autocast(device, precision), _remembering(frozen, batch):
                    logits = steps.model(xb)
                # the loss in float32 (a no-op at precision 32): Dice/CE sums over many voxels lose digits in bf16
                loss = (config.loss_fn or per_sample_loss)(logits.float(), yb).mean()
                loss.backward()
                steps.after_backward()
                steps.optimizer.step()
                if ema is not None:
                    ema.update()
                steps.after_step(loss, len(batch))
            record = steps.epoch_record(epoch)
            if validation is not None:
                val_dice = evaluate_segmentation(base_model, validation[0], validation[1], device=device,
                                                 precision=precision)["mean"]
                record["validation_dice_mean"] = val_dice
                steps.observe_validation(val_dice)
            history.append(record)
            bar.set_postfix({k: (round(v, 4) if isinstance(v, float) else v) for k, v in record.items()
                             if k in ("loss", "noise_multiplier", "epsilon")})
            if checkpoint is not None:   # mid-training weights and the sampling's random state: owner-only
                atomic_save_torch(checkpoint, {
                    "model": base_model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch + 1,
                    "generator": generator.get_state(), "torch_rng": torch.get_rng_state(), "history": history,
                    "dp": steps.state_dict(), "ema": ema.state_dict() if ema is not None else None,
                    "dp_config": steps.config_dict(), **config.extra_checkpoint}, private=True)
    bar.close()

    result = TrainResult(model=base_model, history=history, epochs_completed=len(history),
                         resumed_from_epoch=start_epoch if resume_state is not None else None)
    steps.finish(result)   # DP-SGD: Opacus' hooks removed, the privacy figures from the ledger
    if ema is not None:   # post-processing of the noisy iterates: no privacy cost (De et al. 2022, Sec. 3)
        ema.copy_to(base_model)
    for parameter in base_model.parameters():   # the returned model is a plain, fully trainable module again
        parameter.requires_grad_(True)
    result.wall_seconds = time.perf_counter() - started
    return result


@contextlib.contextmanager
def _frozen_unet_memo(model: torch.nn.Module, config: TrainConfig, private: PrivateTraining | None):
    """A :class:`_FrozenUNetMemo` for this training where it is exact (else None), removed when it ends."""
    memo = _FrozenUNetMemo.for_training(model, config, private)
    try:
        yield memo
    finally:
        if memo is not None:
            memo.remove()


@contextlib.contextmanager
def _remembering(frozen: "_FrozenUNetMemo | None", batch: torch.Tensor):
    """Inside: the frozen U-Net's memo (if any) answers for this training batch; outside (validation, inference)
    it computes as usual."""
    if frozen is None:
        yield
        return
    frozen.batch = batch
    try:
        yield
    finally:
        frozen.batch = None


class _FrozenUNetMemo:
    """The frozen U-Net's output under a voxel head, remembered per batch while only the head trains.

    Why: a voxel-head teacher (docs/decisions/teachers.md) trains 213 weights on one or two patients for 60 epochs
    without augmentation, so every epoch ran the frozen U-Net on the same batch again -- most of a comparison's
    teacher training. The memo is keyed by the batch's sample indices in their order, so a hit returns what the
    U-Net computed for exactly that input tensor (same samples, same order, same batch size, same autocast
    context), and the training is the same bit for bit. It is used only where that holds: plain training (not
    DP-SGD, whose Opacus wrapper hooks every module), no augmentation (the input of a batch is then fixed), every
    U-Net weight frozen, and a U-Net whose output does not depend on train/eval mode or on the other samples
    (:func:`task.learning.headgrad.check_frozen_deterministic`). It holds at most ``budget_bytes`` of outputs; past that it
    computes as before."""

    def __init__(self, unet: torch.nn.Module, budget_bytes: int) -> None:
        self.unet, self.budget, self.used = unet, int(budget_bytes), 0
        self.outputs: dict[tuple[int, ...], torch.Tensor] = {}
        self.batch: torch.Tensor | None = None
        compute = unet.forward

        def remembered(x: torch.Tensor) -> torch.Tensor:
            key = None if self.batch is None else tuple(int(i) for i in self.batch)
            if key is not None and key in self.outputs:
                return self.outputs[key]
            out = compute(x)
            size = out.numel() * out.element_size()
            if key is not None and not out.requires_grad and self.used + size <= self.budget:
                self.outputs[key] = out.detach()
                self.used += size
            return out

        unet.forward = remembered   # an instance attribute: the module's state dict and hooks are unchanged

    def remove(self) -> None:
        """Back to the module's own forward; the remembered outputs are dropped."""
        self.unet.__dict__.pop("forward", None)
        self.outputs.clear()

    @classmethod
    def for_training(cls, model: torch.nn.Module, config: TrainConfig, private: PrivateTraining | None,
                     budget_bytes: int = 512 * 2 ** 20) -> "_FrozenUNetMemo | None":
        if private is not None or config.augment or not isinstance(model, VoxelHeadUNet):
            return None
        if any(p.requires_grad for p in model.model.parameters()):
            return None
        try:
            check_frozen_deterministic(model)
        except UserError:
            return None
        return cls(model.model, budget_bytes)


# ----------------------------------------------------------------------------------- stacked voxel heads
#: how many bytes of intermediate tensors one step of stacked heads (or one group of answers) may hold on the host;
#: on a GPU a quarter of its free memory (:func:`stacked_budget_bytes`)
HOST_STACK_BYTES = 16 * 2 ** 20


def stacked_budget_bytes(device) -> int:
    """The memory a group of stacked voxel heads may fill on ``device`` (its intermediate tensors)."""
    device = resolve_device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(max(HOST_STACK_BYTES, free // 4))
    return HOST_STACK_BYTES


def _groups(count: int, per_item_bytes: int, budget_bytes: int) -> list[range]:
    """``range(count)`` cut into consecutive groups of at most ``budget_bytes // per_item_bytes`` (at least 1)."""
    size = max(1, int(budget_bytes) // max(1, int(per_item_bytes)))
    return [range(start, min(count, start + size)) for start in range(0, count, size)]


def stacked_training_applies(model: torch.nn.Module, config: TrainConfig, private: PrivateTraining | None) -> bool:
    """Whether ``model``'s training under ``config`` may be one of :func:`train_stacked_voxel_heads`' heads: plain
    training (DP-SGD keeps each teacher's own Opacus session, sampling and noise), of the voxel head only, without
    augmentation (then every sample's frozen U-Net output is one fixed tensor), with the default loss, optimiser
    and no checkpoint, moving average or views, on a U-Net whose output does not depend on train/eval mode or on
    the other samples (:func:`task.learning.headgrad.check_unet_deterministic`)."""
    if private is not None or config.augment or not isinstance(model, VoxelHeadUNet):
        return False
    if look_up_option(config.trainable, Trainable, "trainable") is not VOXEL_HEAD:
        return False
    if (config.loss_fn is not None or config.optimizer_factory is not None or config.checkpoint is not None
            or config.ema_decay is not None or int(config.augmentation_multiplicity) != 1):
        return False
    try:
        check_unet_deterministic(model.model)
    except UserError:
        return False
    return True


@torch.no_grad()
def stacked_head_features(unet: torch.nn.Module, images: torch.Tensor, device, precision: str = Precision.FP32,
                          batch_size: int = 4) -> torch.Tensor:
    """``[u(x), x]`` of every scan as (n, C + channels, V) float32 on ``device``: the frozen U-Net run once per
    scan, in training mode under the run's autocast as the training loop runs it (instance normalisation without
    running statistics: the same as eval mode, and per sample)."""
    unet.to(device)
    was_training = unet.training
    unet.train()
    parts = []
    for start in range(0, len(images), int(batch_size)):
        x = images[start:start + int(batch_size)].to(device)
        with autocast(device, precision):
            logits = unet(x)
        parts.append(torch.cat([logits.float(), x], dim=1).flatten(2))
    unet.train(was_training)
    return torch.cat(parts)


def train_stacked_voxel_heads(unet: torch.nn.Module, heads, images: Any, targets: Any,
                              samples: Sequence[Sequence[int]], seeds: Sequence[int], config: TrainConfig,
                              budget_bytes: int | None = None):
    """Train head k of ``heads`` (a :class:`task.learning.networks.StackedVoxelHeads`, in place) on the frozen ``unet`` and
    the samples ``samples[k]`` (indices into ``images`` / ``targets``) as :func:`train_segmentation` trains a
    :class:`task.learning.networks.VoxelHeadUNet` with that head under ``config`` with the seed ``seeds[k]`` -- for every k
    at once; returns ``heads``.

    The same maths, not the same bits: each teacher's batches come from its own generator (``seeds[k]``, the same
    permutation per epoch as the loop draws), its loss is the mean per-sample Dice + CE of its own batch, and its
    head takes the update of its own Adam (:class:`_StackedAdam`: Adam is per coordinate, so one optimiser over
    the stacked heads with a step count per head is K independent Adams). What changes is the float summation
    order (matrix products for 1x1x1 convolutions) and that the frozen U-Net runs once per scan instead of once
    per batch: trained heads agree to float tolerance (tests/test_voxel_head.py), not bit for bit.
    A head with no samples, or ``config.epochs == 0``, keeps its start.

    Args:
        unet: the frozen U-Net every head corrects (a :class:`task.learning.networks.VoxelHeadUNet`'s ``.model``).
        heads: the K heads, each at its start; trained in place.
        images: (n, 4, *g) float training volumes of every teacher together.
        targets: (n, *g) int labels of the same volumes.
        samples: for each head, the indices of its own volumes (disjoint partitions).
        seeds: for each head, its training seed (batch order), as :class:`TrainConfig`'s ``seed``.
        config: epochs, batch size, learning rate, weight decay, device and precision; it must satisfy
            :func:`stacked_training_applies` (checked by the caller).
        budget_bytes: bounds the intermediate tensors of one pass (None: :func:`stacked_budget_bytes`): a step's
            samples (every teacher's batch) go through in chunks that fit it, their gradients summed before the
            step, which changes nothing but the memory.
    """
    if len(samples) != len(heads) or len(seeds) != len(heads):
        raise UserError(f"stacked heads: {len(heads)} heads but {len(samples)} sample lists and {len(seeds)} seeds")
    x_all, y_all = _training_tensors(images, targets, config)
    device = resolve_device(config.compute.device)
    heads.to(device).train()
    if config.epochs <= 0 or not any(len(own) for own in samples):
        return heads
    features = stacked_head_features(unet, x_all, device, config.compute.precision)
    y_all = y_all.to(device)
    classes, grid = heads.classes, y_all.shape[1:]
    # one sample's pass: its features, the hidden layer before and after PReLU (kept for backward), the class
    # scores and the loss's softmax, one-hot and products (about ten class-sized maps)
    per_sample = features.shape[2] * 4 * (features.shape[1] + 3 * heads.first_weight.shape[1] + 10 * classes)
    chunk = max(1, (stacked_budget_bytes(device) if budget_bytes is None else int(budget_bytes)) // per_sample)
    optimizer = _StackedAdam(list(heads.parameters()), config.learning_rate, weight_decay=config.weight_decay)
    for chosen, owners, weights, active in _batch_plan(samples, seeds, config.epochs, config.batch_size, device):
        gradients = None
        for start in range(0, len(chosen), chunk):
            part = slice(start, start + chunk)
            batch = features[chosen[part]]               # (S, C + channels, V): each sample under its teacher's head
            with autocast(device, config.compute.precision):
                scores = batch[:, :classes] + heads.corrections(batch, owners[part])
            losses = per_sample_loss(scores.float().reshape(len(batch), classes, *grid), y_all[chosen[part]])
            found = torch.autograd.grad((losses * weights[part]).sum(), optimizer.parameters)
            gradients = found if gradients is None else [g + f for g, f in zip(gradients, found)]
        optimizer.step(gradients, active)
    return heads


def _batch_plan(samples: Sequence[Sequence[int]], seeds: Sequence[int], epochs: int, batch_size: int, device
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Every step of several teachers trained side by side, as (samples (S,), their teachers (S,), their loss
    weights (S,), active teachers (K,) bool) on ``device``. Teacher k's step sequence is :class:`_PlainTraining`'s
    with generator seed ``seeds[k]``: per epoch one ``randperm`` of its samples cut into batches, each sample of a
    batch weighing 1 / its size (the batch's mean loss); a teacher with no batch left at a step of the epoch is
    inactive there (no update). Drawn up front (a few thousand indices) and copied to the device before the first
    step, so that no step waits on a copy from the host."""
    generators = [torch.Generator().manual_seed(int(seed)) for seed in seeds]
    steps = []
    for _ in range(int(epochs)):
        batches = []
        for own, generator in zip(samples, generators):
            order = torch.randperm(len(own), generator=generator)
            chosen = torch.as_tensor(list(own), dtype=torch.long)[order]
            batches.append([chosen[i:i + batch_size] for i in range(0, len(own), batch_size)])
        for j in range(max(len(b) for b in batches)):
            step = [(k, b[j]) for k, b in enumerate(batches) if j < len(b)]
            active = torch.zeros(len(samples), dtype=torch.bool)
            active[[k for k, _ in step]] = True
            steps.append((torch.cat([batch for _, batch in step]),
                          torch.cat([torch.full((len(batch),), k) for k, batch in step]),
                          torch.cat([torch.full((len(batch),), 1.0 / len(batch)) for _, batch in step]), active))
    on_device = [tuple(t.to(device) for t in step) for step in steps]
    yield from on_device


class _StackedAdam:
    """``torch.optim.Adam``'s update (Kingma & Ba 2014, arXiv 1412.6980, as torch writes it: no AMSGrad, L2 weight
    decay added to the gradient) for parameters stacked along dim 0 over K independent models, each with its own
    step count: at a step where model k is not ``active`` its slice -- parameters, moments, step count -- stays
    exactly as it was (one ``torch.optim.Adam`` over the stack would count the step and move it by its momentum).
    Adam is per coordinate, so this is K independent Adam runs."""

    def __init__(self, parameters: Sequence[torch.Tensor], learning_rate: float, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        self.parameters = list(parameters)
        self.learning_rate, self.betas, self.eps = float(learning_rate), betas, float(eps)
        self.weight_decay = float(weight_decay)
        first = self.parameters[0]
        self.steps = torch.zeros(len(first), dtype=torch.float64, device=first.device)
        self.first_moments = [torch.zeros_like(p) for p in self.parameters]
        self.second_moments = [torch.zeros_like(p) for p in self.parameters]

    @torch.no_grad()
    def step(self, gradients: Sequence[torch.Tensor], active: torch.Tensor) -> None:
        beta1, beta2 = self.betas
        self.steps += active.to(self.steps.dtype)
        steps = self.steps.clamp(min=1.0)    # an inactive model's update is computed and discarded
        step_size = (self.learning_rate / (1.0 - beta1 ** steps)).to(self.parameters[0].dtype)
        correction = torch.sqrt(1.0 - beta2 ** steps).to(self.parameters[0].dtype)
        for parameter, gradient, first, second in zip(self.parameters, gradients, self.first_moments,
                                                      self.second_moments):
            shape = (-1,) + (1,) * (parameter.dim() - 1)
            keep = active.view(shape)
            if self.weight_decay:
                gradient = gradient.add(parameter, alpha=self.weight_decay)
            new_first = first.lerp(gradient, 1.0 - beta1)
            new_second = torch.addcmul(second * beta2, gradient, gradient, value=1.0 - beta2)
            denominator = (new_second.sqrt() / correction.view(shape)).add_(self.eps)
            moved = parameter + (-step_size).view(shape) * (new_first / denominator)
            first.copy_(torch.where(keep, new_first, first))
            second.copy_(torch.where(keep, new_second, second))
            parameter.copy_(torch.where(keep, moved, parameter))


@torch.no_grad()
def stacked_head_probabilities(unet: torch.nn.Module, heads, images: Any, batch_size: int = 2, device: Any = None,
                               precision: str = Precision.FP32, budget_bytes: int | None = None
                               ) -> Iterator[tuple[range, torch.Tensor]]:
    """The softmax output of every :class:`task.learning.networks.VoxelHeadUNet` made of the U-Net ``unet`` and one head of
    ``heads`` (:class:`task.learning.networks.StackedVoxelHeads`) on ``images``, as ``(heads k, probabilities (len(k), n, C,
    *g) float32 on device)`` for consecutive groups of heads -- the U-Net run once per scan, every head of a group
    in one batched product, nothing copied to the host.

    What :func:`predict_probs` gives for each such network, up to float summation order: the same batches of
    ``batch_size`` scans through the U-Net, the same autocast context, the softmax on float32 scores.

    Args:
        unet: the U-Net every head corrects (a :class:`task.learning.networks.VoxelHeadUNet`'s ``.model``).
        heads: the heads (:class:`task.learning.networks.StackedVoxelHeads`).
        images: (n, 4, *g) volumes.
        batch_size: volumes per U-Net pass (:func:`predict_probs`' default).
        device / precision: as :func:`predict_probs` (None = where ``unet`` is; ``"bf16"`` = autocast).
        budget_bytes: bounds a group's output and intermediates (None: :func:`stacked_budget_bytes`).
    """
    device = model_device(unet) if device is None else resolve_device(device)
    unet.to(device).eval()
    heads.to(device).eval()
    x_all = _as_tensor(images, torch.float32)
    batches = []
    for start in range(0, len(x_all), batch_size):
        x = x_all[start:start + batch_size].to(device)
        with autocast(device, precision):
            batches.append((x, unet(x)))
    if not batches:
        return
    n, voxels = len(x_all), int(np.prod(x_all.shape[2:]))
    hidden = heads.first_weight.shape[1]
    per_head = 4 * voxels * (n * heads.classes + batch_size * 2 * hidden)
    budget = stacked_budget_bytes(device) if budget_bytes is None else int(budget_bytes)
    for group in _groups(len(heads), per_head, budget):
        part = heads if len(group) == len(heads) else heads.subset(group)
        out = torch.empty((len(group), n, heads.classes, *x_all.shape[2:]), dtype=torch.float32, device=device)
        at = 0
        for x, logits in batches:
            with autocast(device, precision):
                scores = part(logits, x)
            out[:, at:at + len(x)] = torch.softmax(scores.float(), dim=2)
            at += len(x)
        yield group, out


class _ParameterAverage:
    """Exponential moving average of the trained parameters over optimiser steps (Polyak averaging; De et
    al. 2022, arXiv 2204.13650, use it for DP-SGD). It reads only the iterates DP-SGD already released, so the
    average is post-processing: it costs no privacy and needs no accounting."""

    def __init__(self, model: torch.nn.Module, decay: float) -> None:
        self.decay = float(decay)
        self.parameters = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.average = {n: p.detach().clone() for n, p in self.parameters.items()}

    @torch.no_grad()
    def update(self) -> None:
        for name, parameter in self.parameters.items():
            self.average[name].mul_(self.decay).add_(parameter.detach(), alpha=1.0 - self.decay)

    @torch.no_grad()
    def copy_to(self, model: torch.nn.Module) -> None:
        for name, parameter in model.named_parameters():
            if name in self.average:
                parameter.copy_(self.average[name])

    def state_dict(self) -> dict:
        return {name: value.detach().cpu() for name, value in self.average.items()}

    def load_state_dict(self, state: dict) -> None:
        for name, value in state.items():
            self.average[name] = value.to(self.average[name].device).clone()


def _unwrap(wrapped: torch.nn.Module) -> None:
    """Remove Opacus hooks so the returned model behaves like a plain module again."""
    for name in ("_close", "remove_hooks"):
        fn = getattr(wrapped, name, None)
        if callable(fn):
            try:
                fn()
            except Exception:  # already removed / not applicable
                pass
            return


# -------------------------------------------------------------------------------------------- inference
@torch.no_grad()
def predict_probs(model: torch.nn.Module, images: Any, batch_size: int = 2, device: Any = None,
                  precision: str = Precision.FP32, mirror: bool = False) -> np.ndarray:
    """Softmax class probabilities (n, C, *g) float32, as a host array.

    Args:
        model: the segmentation network.
        images: (n, 4, *g) volumes.
        batch_size: volumes per forward pass.
        device: where to run (the model is moved there); None = wherever the model already is.
        precision: "bf16": the forward pass under autocast, the softmax on float32 logits.
        mirror: test-time mirroring (``task.learning.inference``), as released models are scored; False = one pass.
    """
    device = model_device(model) if device is None else resolve_device(device)
    model.to(device)
    x_all = _as_tensor(images, torch.float32)
    was_training = model.training
    model.eval()
    outs = []
    for start in range(0, len(x_all), batch_size):
        x = x_all[start:start + batch_size].to(device)
        with autocast(device, precision):
            out = mirrored_probabilities(model, x) if mirror else model(x)
        # mirrored: already the float32 mean of the probabilities; one pass: logits, the softmax on float32
        probs = out if mirror else torch.softmax(out.float(), dim=1)
        outs.append(probs.cpu().numpy().astype(np.float32))
    model.train(was_training)
    if not outs:
        return np.zeros((0,), dtype=np.float32)
    return np.concatenate(outs, axis=0)


def predict_labels(model: torch.nn.Module, images: Any, batch_size: int = 2, device: Any = None,
                   precision: str = Precision.FP32, mirror: bool = False) -> np.ndarray:
    """The argmax class (n, *g) int64 of :func:`predict_probs`.

    Args:
        model / images / batch_size / device / precision / mirror: as :func:`predict_probs`.
    """
    return predict_probs(model, images, batch_size, device, precision, mirror).argmax(axis=1).astype(np.int64)


@timed("evaluation")
def evaluate_segmentation(model: torch.nn.Module, images: Any, labels: Any, batch_size: int = 2,
                          device: Any = None, precision: str = Precision.FP32) -> dict:
    """Dice dict (``task.learning.metrics.dice_scores``) of the model's argmax prediction against ``labels``: the first
    half of :func:`evaluate_segmentation_per_case`.

    Args:
        model / images / labels / batch_size / device / precision: as :func:`evaluate_segmentation_per_case`.
    """
    return evaluate_segmentation_per_case(model, images, labels, batch_size, device, precision)[0]


class PerCaseDice(list):
    """Per-case mean Dice (a list, as results.json's ``dice_per_case`` has always been) that also carries
    each case's Dice per class and region, ``by_class`` (``None`` where the truth lacks that class; results
    store it as ``dice_per_case_class``). One evaluation gives both, so every producer that already pairs
    test cases gets the per-class pairing the report's headroom per class needs for free."""

    by_class: dict[str, list[float | None]]

    def __init__(self, values=(), by_class: dict | None = None):
        super().__init__(values)
        self.by_class = dict(by_class or {})


@timed("evaluation")
def evaluate_segmentation_per_case(model: torch.nn.Module, images: Any, labels: Any, batch_size: int = 2,
                                   device: Any = None, precision: str = Precision.FP32,
                                   mirror: bool = False) -> tuple[dict, PerCaseDice]:
    """(Dice dict, per-case mean Dice with ``.by_class``) -- results.json stores the latter as
    ``dice_per_case`` and its ``by_class`` as ``dice_per_case_class`` (:func:`per_class_of`).

    Args:
        model: the segmentation network.
        images: (n, 4, *g) volumes.
        labels: (n, *g) int labels.
        batch_size: volumes per forward pass.
        device / precision / mirror: as :func:`predict_probs` (None = where the model is; ``"bf16"`` =
            autocast; test-time mirroring).
    """

    return _scored_per_case(model, images, labels, batch_size, device, precision, mirror)[:2]


def _scored_per_case(model: torch.nn.Module, images: Any, labels: Any, batch_size: int, device: Any,
                     precision: str, mirror: bool) -> tuple[dict, PerCaseDice, np.ndarray]:
    """:func:`evaluate_segmentation_per_case` and the label maps (n, *g) uint8 it scored."""
    x_all = _as_tensor(images, torch.float32)
    y_all = np.asarray(labels)
    acc = DiceAccumulator()
    predicted = []
    for start in range(0, len(x_all), batch_size):
        pred = predict_labels(model, x_all[start:start + batch_size], batch_size, device, precision, mirror)
        acc.add(pred, y_all[start:start + batch_size].astype(np.int64))
        predicted.append(pred.astype(np.uint8))
    labels_out = np.concatenate(predicted) if predicted else np.zeros((0,), np.uint8)
    return acc.aggregate(), PerCaseDice(acc.case_means(), acc.case_table()), labels_out


@timed("evaluation")
def evaluate_release(model: torch.nn.Module, images: Any, labels: Any, device: Any = None,
                     precision: str = Precision.FP32) -> tuple[dict, PerCaseDice]:
    """How every released model is scored on the phantom test set: :func:`evaluate_segmentation_per_case`
    with test-time mirroring (``task.learning.inference``), as ``fedpate predict`` and the real-scan check run it."""
    return evaluate_segmentation_per_case(model, images, labels, device=device, precision=precision, mirror=True)


def evaluate_release_predicting(model: torch.nn.Module, images: Any, labels: Any, device: Any = None,
                                precision: str = Precision.FP32) -> tuple[dict, PerCaseDice, np.ndarray]:
    """:func:`evaluate_release` and the test label maps (n, *g) uint8 it scored: what a run writes as its test
    predictions, without predicting the 8 mirrorings of every test scan a second time."""
    return _scored_per_case(model, images, labels, 2, device, precision, True)


def dice_of_probabilities(probs: np.ndarray, labels: Any, batch_size: int = 2) -> dict:
    """:func:`evaluate_segmentation`'s Dice dict from the model's probabilities on the same images, already
    computed (:func:`predict_probs`' or :func:`stacked_head_probabilities`' output): the same argmax and the same
    accumulation, ``batch_size`` cases at a time."""
    return dice_of_labels(np.asarray(probs).argmax(axis=1), labels, batch_size)


def dice_of_labels(predicted: np.ndarray, labels: Any, batch_size: int = 2) -> dict:
    """:func:`dice_of_probabilities` from the argmax labels (n, *g) already taken (on the device that has the
    probabilities: only the labels come to the host)."""
    y_all = np.asarray(labels)
    acc = DiceAccumulator()
    for start in range(0, len(predicted), batch_size):
        acc.add(np.asarray(predicted[start:start + batch_size]).astype(np.int64),
                y_all[start:start + batch_size].astype(np.int64))
    return acc.aggregate()


def per_class_of(per_case: Any) -> dict[str, list[float | None]] | None:
    """The per-class table of an :func:`evaluate_segmentation_per_case` result (None for a plain list)."""
    return getattr(per_case, "by_class", None) or None


def public_validation_dice(model, world, device: Any = None, precision: str = Precision.FP32) -> float | None:
    """Mean Dice of ``model`` on the public validation set of ``world`` (a :class:`task.world.PublicWorld`).
    Public labels: free to use for choosing a model or a setting; the test set never is. None when the
    world has no validation set."""
    if world.validation_images is None or not len(world.validation_images):
        return None
    return evaluate_segmentation(model, world.validation_images, world.validation_labels, device=device,
                                 precision=precision).get("mean")
