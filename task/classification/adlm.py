"""AdLM — Adaptive Laplace Mechanism (Phan, Wu, Hu & Dou 2017, arXiv 1709.05750) and its ILM ablation.

Algorithm 1 of the paper, three Laplace releases composed by basic composition (Theorem 1):

1. **ε1 — private relevance** (Sec. III-A, eq. 10-12, Lemma 1). Per-record LRP relevances of every input
   feature, min-max normalised per record (Sec. II-C), averaged over D, plus ``Lap(Δ_R/ε1)`` per feature
   with ``Δ_R = 2d/|D|`` (Lemma 1, eq. 13). The LRP network is trained on the *public* labelled reference
   split: the paper trains it on D itself, which makes each record's relevance depend on every other record
   and breaks Lemma 1's sensitivity; with a public network Lemma 1 holds exactly.
2. **ε2 — first affine layer with adaptive noise** (Sec. III-B, eq. 14-21, Lemma 3-4). Feature j gets the
   budget share ``β_j = d|R̄_j| / Σ_j|R̄_j|`` (eq. 16), ``ε_j = β_j ε2 / d`` here, and every record's feature
   is perturbed once, ``x̄_ij = x_ij + Lap(Δ_x/ε_j)``, x ∈ [0, 1] (enforced by clipping), Δ_x = 1 per feature
   under replace-one. Privacy loss per record ``Σ_j Δ_x/b_j = Σ_j β_j ε2/d = ε2``. The first layer then
   only ever sees x̄ (eq. 19-21: ``h̄ = Σ_i (x̄_i Wᵀ + b̄)``), so training for any number of epochs is
   post-processing. ILM (Appendix C): β_j = 1 for all j (identical noise, no relevance needed).
3. **ε3 — perturbed polynomial loss** (Sec. III-C, eq. 23-25, Lemma 5-6). The cross-entropy of logistic
   outputs ``ŷ_l = σ(𝔥̄ W_lᵀ)`` is replaced by its 2nd-order Taylor expansion at 0 (eq. 25):
   ``Σ_l [log 2 + (½ − y_l) z_l + ⅛ z_l²]``, z_l = 𝔥̄ W_lᵀ. Only ``φ⁽¹⁾_l = ½ − y_l`` depends on data
   (φ⁽⁰⁾ = log 2 and φ⁽²⁾ = ⅛ are constants, Appendix D); each record's φ⁽¹⁾ gets ``Lap(Δ_y/ε3)``, Δ_y = 2
   (a one-hot label changes two entries by 1 under replace-one).

Privacy unit (``task.classification`` module note): the releases perturb records one by one, so on the slice task every
patient contributes exactly k = ``records_per_patient`` slices (``task.classification.capped_units``) and each
sensitivity is that of k records — Δ_R = 2dk/|D|, feature scales and Δ_y multiplied by k — so ε1, ε2, ε3 hold
per patient under replace-one patient (each slice's noise is sized for ε/k). On mnist5k k = 1.

Randomness (docs/PRIVACY.md, "Noise"): each of the three releases draws its Laplace noise from its own stream of a
``privacy.mechanisms.NoiseSource`` (secure unless a simulation asks for reproducible noise), named by its
release id and opened only after the release is charged; the training shuffles afterwards only
post-process released data and may follow the seed.

Normalisation layers (Sec. III-B, "Local Response Normalization" for fully connected layers): after each
hidden ReLU, ``(h − χ)/(φ − χ)`` with χ, φ the per-neuron batch min and max, so 𝔥̄ ∈ [0, 1].

**The honest noise scale, and why the paper's accuracy claim does not carry over** (a documented negative
result; the comparison report shows AdLM/ILM beside a noise-free row of the same network, loss and optimiser).
Here every record's features are perturbed ONCE, ``x̄_ij = x_ij + Lap(d/(β_j ε2))`` (x ∈ [0, 1], replace-one),
and its label coefficients once, ``Lap(2/ε3)``; training on them for any number of epochs is then
post-processing. On mnist5k at ε = 2 that is a Laplace scale of several hundred per pixel (the report's
``feature Laplace scale``), for pixels in [0, 1]: the model stays at chance, while the noise-free row learns.
Phan, Wu, Hu & Dou 2017 ("Adaptive Laplace Mechanism: Differential Privacy Preservation in Deep Learning",
ICDM 2017, arXiv 1709.05750; corrected version) report 90 % on MNIST at ε = 0.25 with far less noise. That
claim rests on four steps that do not hold:

1. **The batch-sum step.** Alg. 1 adds ``(1/|L|)·Lap(Δ_h0/ε_j)`` to every record's feature, and the proof of
   Lemma 4 (Proof 4, Eq. 20 → 21; again for ILM in Appendix C, Eq. 28 → 29) rewrites the batch sum
   ``Σ_{x_i∈L} (x_ij + (1/|L|)·Lap(Δ_h0/ε_j))`` as ``Σ_i x_ij + Lap(Δ_h0/ε_j)``: |L| independent draws of
   ``Lap(b/|L|)`` are replaced by one draw of ``Lap(b)``. Their sum is not ``Lap(b)``: its standard deviation
   is ``b·√(2/|L|)``, √|L| times smaller than the draw the privacy argument then uses.
2. **Post-processing does not cover per-record training.** Even with the sum settled, the network never
   consumes that sum: each record's perturbed features go through the ReLU layers and the loss on their own,
   so what training uses is every record with noise ``Lap(Δ_h0/(|L| ε_j))`` — |L| times below one record's
   sensitivity. Training is post-processing only of what was released; the per-record inputs were not
   released at the scale their sensitivity needs.
3. **The relevance model is trained on the private data.** Lemma 1's ``Δ_R = 2d/|D|`` needs each record's
   relevance to depend on that record alone; the paper's pre-trained LRP model is learned noise-free on the
   training data (Sec. V: "the pre-trained model is noiseless", "12 ... extra epochs" on MNIST) and is not
   accounted, so every record's relevance depends on all of D. Here the LRP network is trained on the public
   labelled reference set, and Lemma 1 holds.
4. **The released code shares one noise image per batch and redraws it at every step**
   (``AdLM/MNIST/AdLM.py`` in github.com/haiphanNJIT/PrivateDeepLearning: ``generateNoise`` is called once per
   training step and broadcast to all records of the batch). A shared draw makes Eq. 21 hold for the sum,
   but every record is still released with that per-record scale, and a fresh release at every step
   composes over all steps instead of being post-processed.

With the code's MNIST settings (Δ_h0 = 2·14·14·25 = 9800, |L| = 1800, ε2 = 0.075, 784 pixels in [0, 1],
identical noise β_j = 1), one record's perturbed image is a Laplace release of per-record
``ε = Σ_j |L|·ε2/Δ_h0 = 784 · 1800 · 0.075 / 9800 ≈ 10.8`` — each time the record is used, for a claimed
ε2 = 0.075 — before composing over the steps. The per-record scales here are that calculation done the other
way round: the noise one record's guarantee needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from privacy.events import LaplaceEvent
from privacy.mechanisms import LaplaceMechanism, NoiseSource
from task.classification import (PlainTraining, PrivacyUnit, SeedResult, SeedRun, accuracy, capped_units, set_seed,
                                 train_nonprivate)
from task.errors import UserError
from task.options import Relation

FEATURE_SENSITIVITY = 1.0   # |x_ij − x'_ij| ≤ 1 for x ∈ [0, 1] (Lemma 3's domain), replace-one
LABEL_SENSITIVITY = 2.0     # ||(½ − y) − (½ − y')||_1 for one-hot y, y' (replace-one)


@dataclass(frozen=True)
class AdLMConfig:
    hidden: tuple[int, ...] = (64, 32)      # h0 (private affine layer) and one stacked hidden layer
    epochs: int = 20
    batch_size: int = 128
    lr: float = 1e-2     # Adam; the first measurement's setting, kept (docs/decisions/classification.md)
    budget_split: tuple[float, float, float] = (0.2, 0.5, 0.3)   # ε1, ε2, ε3 fractions (ILM: ε1 → ε2)
    relevance_hidden: tuple[int, ...] = (64,)
    relevance_epochs: int = 30
    lrp_epsilon: float = 1e-6
    records_per_patient: int = 4            # k slices per patient on the slice task (noise grows with k)

    def __post_init__(self) -> None:
        object.__setattr__(self, "hidden", tuple(self.hidden))
        if len(self.budget_split) != 3 or any(f < 0 for f in self.budget_split) or not sum(self.budget_split) > 0:
            raise UserError(f"adlm: budget_split must be three non-negative shares of ε (ε1, ε2, ε3), got "
                            f"{self.budget_split}")
        if self.epochs < 0 or self.batch_size < 1:
            raise UserError(f"adlm: expected epochs >= 0 and a positive batch size, got {self.epochs}, "
                            f"{self.batch_size}")


# --------------------------------------------------------------------------------------------- LRP
def lrp_relevance(model: torch.nn.Sequential, x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """LRP-ε (Bach et al. 2015; paper Sec. II-C, eq. 7-9) of a Linear/ReLU net, for the predicted class.

    Returns per-record relevances (n, d), min-max normalised per record to [0, 1] (Sec. II-C).
    """
    acts, h = [x], x
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        for m in model:
            h = m(h)
            if isinstance(m, torch.nn.ReLU):
                acts.append(h)
        logits = h
        rel = torch.zeros_like(logits)
        top = logits.argmax(dim=1)
        rel[torch.arange(len(x)), top] = logits[torch.arange(len(x)), top]
        for layer, a in zip(reversed(linears), reversed(acts)):
            z = a @ layer.weight.T + layer.bias
            z = z + eps * torch.where(z >= 0, 1.0, -1.0)
            rel = a * ((rel / z) @ layer.weight)
    lo = rel.min(dim=1, keepdim=True).values
    hi = rel.max(dim=1, keepdim=True).values
    return (rel - lo) / torch.clamp(hi - lo, min=1e-12)


def relevance_sensitivity(d: int, n: int, group: int = 1) -> float:
    """Δ_R = 2d/|D| (Lemma 1, eq. 13; replace-one record); replacing a unit of ``group`` records: 2dk/|D|."""
    return 2.0 * d * group / n


def private_relevance(per_record: np.ndarray, epsilon1: float, guard, owners, release_id: str, noise,
                      group: int = 1) -> np.ndarray:
    """R̄_j = (1/|D|) Σ_i R_{x_ij} + Lap(Δ_R/ε1) (eq. 12); charged as LaplaceEvent(Δ_R, Δ_R/ε1), then drawn
    from ``noise``'s stream ``release_id``.

    Args:
        per_record: (|D|, d) per-record relevances (clipped to [0, 1], as :func:`lrp_relevance` gives them).
        epsilon1: ε1, this release's budget.
        guard: the budget guard the release is charged through before its noise is drawn.
        owners: the ledger owners charged (the hospitals whose records are pooled).
        release_id: the ledger's release id, which also names the noise stream.
        noise: the ``privacy.mechanisms.NoiseSource`` of the noise.
        group: records per privacy unit (k; 1 = one record is the unit).
    """

    per_record = np.clip(np.asarray(per_record, np.float64), 0.0, 1.0)   # bounded by construction
    n, d = per_record.shape
    sens = relevance_sensitivity(d, n, group)
    scale = sens / epsilon1
    guard.charge(owners, LaplaceEvent(sensitivity=sens, scale=scale, relation=Relation.REPLACE_ONE),
                 release_id=release_id, note={"step": "adlm-relevance", "d": d, "n": n, "records_per_unit": group})
    return np.asarray(LaplaceMechanism(scale, noise.generator(release_id))(per_record.mean(axis=0)))


def budget_ratios(noisy_relevance: np.ndarray | None, d: int) -> np.ndarray:
    """β_j = d|R̄_j| / Σ_j |R̄_j| (eq. 16); ILM (``None``) = all ones. Σ_j β_j = d."""
    if noisy_relevance is None:
        return np.ones(d)
    a = np.abs(np.asarray(noisy_relevance, np.float64))
    total = a.sum()
    return np.ones(d) if total <= 0 else d * a / total


def feature_scales(beta: np.ndarray, epsilon2: float, group: int = 1) -> np.ndarray:
    """Per-feature Laplace scales b_j = k Δ_x d / (β_j ε2) for units of k = ``group`` records (shares β_j of
    eq. 16, ε2/k per record; ∞ where β_j = 0: the feature is withheld)."""
    d = len(beta)
    with np.errstate(divide="ignore"):
        return np.where(beta > 0, group * FEATURE_SENSITIVITY * d / (beta * epsilon2), np.inf)


def perturb_features(x: np.ndarray, scales: np.ndarray, guard, owners, release_id: str, noise,
                     group: int = 1) -> np.ndarray:
    """x̄_ij = clip(x_ij, 0, 1) + Lap(b_j) (Alg. 1 lines 10-13, per-record calibration; see module doc).

    Charged as one Laplace mechanism on the whitened records ``x_j / b_j`` (scale 1), whose L1 sensitivity
    for a unit of k = ``group`` records is ``k Σ_j Δ_x / b_j`` (= ε2 by construction of ``feature_scales``).
    Withheld features (b_j = ∞) are replaced by 0.5.

    Args:
        x: (n, d) records (clipped to [0, 1]).
        scales: per-feature Laplace scales b_j (:func:`feature_scales`; ∞ = withheld).
        guard: the budget guard the release is charged through before its noise is drawn.
        owners: the ledger owners charged.
        release_id: the ledger's release id, which also names the noise stream.
        noise: the ``privacy.mechanisms.NoiseSource`` of the noise.
        group: records per privacy unit (k; 1 = one record is the unit).
    """

    x = np.clip(np.asarray(x, np.float64), 0.0, 1.0)
    finite = np.isfinite(scales)
    eps = group * float(np.sum(FEATURE_SENSITIVITY / scales[finite]))
    guard.charge(owners, LaplaceEvent(sensitivity=eps, scale=1.0, relation=Relation.REPLACE_ONE), release_id=release_id,
                 note={"step": "adlm-affine", "d": int(len(scales)), "withheld": int((~finite).sum()),
                       "records_per_unit": group})
    white = np.where(finite, x / np.where(finite, scales, 1.0), 0.0)
    noisy = np.asarray(LaplaceMechanism(1.0, noise.generator(release_id))(white))
    return np.where(finite, noisy * np.where(finite, scales, 1.0), 0.5).astype(np.float32)


def perturb_label_coefficients(y: np.ndarray, classes: int, epsilon3: float, guard, owners, release_id: str,
                               noise, group: int = 1) -> np.ndarray:
    """φ̄⁽¹⁾_il = (½ − y_il) + Lap(kΔ_y/ε3) (eq. 25, Alg. 1 lines 16-19, per-record calibration).

    Args:
        y: (n,) integer labels.
        classes: the number of classes (the width of the one-hot labels).
        epsilon3: ε3, this release's budget.
        guard: the budget guard the release is charged through before its noise is drawn.
        owners: the ledger owners charged.
        release_id: the ledger's release id, which also names the noise stream.
        noise: the ``privacy.mechanisms.NoiseSource`` of the noise.
        group: records per privacy unit (k; 1 = one record is the unit).
    """

    scale = group * LABEL_SENSITIVITY / epsilon3
    guard.charge(owners,
                 LaplaceEvent(sensitivity=group * LABEL_SENSITIVITY, scale=scale, relation=Relation.REPLACE_ONE),
                 release_id=release_id, note={"step": "adlm-loss", "classes": classes, "records_per_unit": group})
    phi = 0.5 - np.eye(classes)[np.asarray(y)]
    return np.asarray(LaplaceMechanism(scale, noise.generator(release_id))(phi)).astype(np.float32)


# --------------------------------------------------------------------------------------------- network
class MinMaxNorm(torch.nn.Module):
    """𝔥̄ = (h − χ)/(φ − χ) with per-neuron batch min χ and max φ (paper Sec. III-B).

    Batch statistics are used at evaluation too (the test set is evaluated as one batch): the running
    values collected on the heavily perturbed training inputs do not describe clean inputs. A single record
    falls back to the running values.
    """

    def __init__(self, width: int, momentum: float = 0.1):
        super().__init__()
        self.momentum = momentum
        self.register_buffer("lo", torch.zeros(width))
        self.register_buffer("hi", torch.ones(width))

    def forward(self, h):
        if h.shape[0] > 1:
            lo, hi = h.min(dim=0).values.detach(), h.max(dim=0).values.detach()
            if self.training:
                with torch.no_grad():
                    self.lo.lerp_(lo, self.momentum)
                    self.hi.lerp_(hi, self.momentum)
        else:
            lo, hi = self.lo, self.hi
        return torch.clamp((h - lo) / torch.clamp(hi - lo, min=1e-6), 0.0, 1.0)


def build_adlm_net(d: int, hidden: tuple[int, ...], classes: int) -> torch.nn.Sequential:
    """AdLM's network: Linear → ReLU → :class:`MinMaxNorm` per hidden layer, then ``z_l = 𝔥̄ W_lᵀ + b_l``.

    Eq. 23 has no output bias; this one has, because the polynomial loss needs a per-class offset that the
    normalised features cannot give: every :class:`MinMaxNorm` unit is 0 on some record of each batch, so no
    feature is constant (see :func:`constant_output_minimiser`).
    """
    layers, width = [], d
    for h in hidden:
        layers += [torch.nn.Linear(width, h), torch.nn.ReLU(), MinMaxNorm(h)]
        width = h
    layers.append(torch.nn.Linear(width, classes))
    return torch.nn.Sequential(*layers)


def taylor_loss(logits: torch.Tensor, phi1: torch.Tensor) -> torch.Tensor:
    """Perturbed polynomial loss (eq. 25 / Alg. 1 line 27), mean over the batch: Σ_l φ̄⁽¹⁾_l z_l + ⅛ z_l²."""
    return (phi1 * logits + logits * logits / 8.0).sum(dim=1).mean()


def constant_output_minimiser(phi1: np.ndarray) -> np.ndarray:
    """The constant outputs ``z_l = c_l`` that minimise :func:`taylor_loss` over the records: ``c_l = −4·mean_i
    φ̄⁽¹⁾_il`` (the loss is ``mean_i φ̄_il c_l + c_l²/8`` per class; its derivative vanishes there).

    Without noise ``c_l = 4p_l − 2`` for class frequencies p_l, about −1.6 on ten balanced classes: the
    one-vs-all targets of Eq. 25 (z = +2 for the class, −2 for the others) are far from the near-zero outputs
    of a fresh network, and all classes pull the same way. Without an output bias (Eq. 23) or with one started
    near zero, that shared pull dominates the gradients: it flows back through the non-negative normalised
    features and switches off more hidden units than cross-entropy does, and how far the network gets in a
    fixed number of epochs depends on the seed. Starting the output bias here leaves the records' class
    differences as the signal. A function of the released φ̄⁽¹⁾ alone, so it is post-processing of the ε3
    release.
    """
    return -4.0 * np.asarray(phi1, np.float64).mean(axis=0)


def train_adlm(run: SeedRun, cfg: AdLMConfig | None = None, adaptive: bool = True) -> SeedResult:
    """AdLM (``adaptive=True``) or ILM (``adaptive=False``) on the pooled private records.

    All three releases are made (and charged) before training; the epochs only post-process them, so the
    ledger's ε is ε1 + ε2 + ε3 whatever ``cfg.epochs`` is (Theorem 1).

    Args:
        run: the task (its pooled private records; the public reference records train the LRP network), the
            budget, split into ε1, ε2, ε3 by ``cfg.budget_split`` (ILM gives ε1's share to ε2; None trains the
            noise-free reference: the mechanism switched off, nothing released or charged, NOT private), δ
            (recorded in the result only: the three Laplace releases are pure ε-DP), the guard and owners every
            release is charged to before its noise is drawn, ``run.seed`` (the networks' initialisation and the
            training's batch order, not the noise), the prefix of the three release ids (default: the method's
            name) and ``run.progress`` (the test accuracy after every epoch).
        cfg: the network, training and budget-split settings (None = :class:`AdLMConfig`'s defaults).
        adaptive: AdLM (relevance-weighted feature noise) when True, ILM (identical feature noise) when False.
    """

    cfg = cfg or AdLMConfig()
    noise = run.noise if run.noise is not None else NoiseSource()
    task = run.task
    method = "adlm" if adaptive else "ilm"
    set_seed(run.seed)
    x, y, k, units = _private_records(task, cfg)
    n, d = x.shape
    if run.private:
        releases = _releases(run, cfg, adaptive, x, y, k, noise, run.prefix(method))
    else:
        releases = _noise_free(x, y, task.n_classes)
    model = _train_on_releases(run, cfg, releases, method, d)
    scales, (e1, e2, e3) = releases.scales, releases.epsilons
    finite = np.isfinite(scales)
    private = run.private
    return SeedResult(
        method=method, accuracy=accuracy(model, np.clip(task.x_test, 0, 1), task.y_test), epsilon_budget=run.epsilon,
        delta=run.delta, relation=Relation.REPLACE_ONE if private else None, sigma=None,
        details={"epsilon_split": [e1, e2, e3] if private else None, "epochs": cfg.epochs, "lr": cfg.lr,
                 "hidden": list(cfg.hidden), "noise_free": not private,
                 "feature_scale_median": float(np.median(scales[finite])) if finite.any() else None,
                 "feature_scale_min": float(scales[finite].min()) if finite.any() else None,
                 "label_scale": k * LABEL_SENSITIVITY / e3 if private else None,
                 "relevance_scale": relevance_sensitivity(d, n, k) / e1 if private and adaptive else None,
                 "privacy_unit": task.privacy_unit, "units": len(units), "records_per_unit": k,
                 "features_withheld": int((~finite).sum()) if private else 0},
        model=model,
    )


def _private_records(task, cfg: AdLMConfig):
    """``(x, y, k, units)``: the pooled private records AdLM uses, exactly k of every unit (k = 1 when a record
    is the unit, else ``cfg.records_per_patient``)."""
    units = task.unit_records()
    k = 1 if task.privacy_unit is PrivacyUnit.RECORD else cfg.records_per_patient
    chosen = capped_units(units, k).reshape(-1)            # exactly k records per unit
    return np.asarray(task.x_private, np.float32)[chosen], np.asarray(task.y_private, np.int64)[chosen], k, units


@dataclass(frozen=True)
class _Releases:
    """What training sees: the perturbed features x̄ and label coefficients φ̄⁽¹⁾, the per-feature Laplace
    scales (∞ = no noise, or withheld) and the budget split (None each without a budget)."""

    x_bar: np.ndarray
    phi1: np.ndarray
    scales: np.ndarray
    epsilons: tuple = (None, None, None)


def _releases(run: SeedRun, cfg: AdLMConfig, adaptive: bool, x: np.ndarray, y: np.ndarray, k: int, noise,
              prefix: str) -> _Releases:
    """Algorithm 1's three releases, each charged before its noise is drawn (``<prefix>/relevance``,
    ``<prefix>/affine``, ``<prefix>/loss``); ILM skips the relevance and gives ε1's share to the features."""
    task, guard, owners = run.task, run.guard, run.owners
    d = x.shape[1]
    f1, f2, f3 = cfg.budget_split
    if not adaptive:                         # ILM needs no relevance: give ε1's share to the features
        f1, f2 = 0.0, f1 + f2
    total = f1 + f2 + f3
    # (1 − 1e-9): floating-point sums of the per-feature terms must not round past the budget
    e1, e2, e3 = (run.epsilon * (1 - 1e-9) * f / total for f in (f1, f2, f3))
    noisy_relevance = None
    if adaptive:
        if len(task.y_reference) == 0:
            raise UserError("adlm: the task has no public labelled reference records for the LRP network")
        ref_model = train_nonprivate(task.x_reference, task.y_reference, task.n_classes,
                                     PlainTraining(hidden=cfg.relevance_hidden, epochs=cfg.relevance_epochs),
                                     seed=run.seed)
        per_record = lrp_relevance(ref_model, torch.as_tensor(x), cfg.lrp_epsilon).numpy()
        noisy_relevance = private_relevance(per_record, e1, guard, owners, f"{prefix}/relevance", noise, k)
    beta = budget_ratios(noisy_relevance, d)
    scales = feature_scales(beta, e2, k)
    x_bar = perturb_features(x, scales, guard, owners, f"{prefix}/affine", noise, k)
    phi1 = perturb_label_coefficients(y, task.n_classes, e3, guard, owners, f"{prefix}/loss", noise, k)
    return _Releases(x_bar, phi1, scales, (e1, e2, e3))


def _noise_free(x: np.ndarray, y: np.ndarray, classes: int) -> _Releases:
    """The noise-free reference (NOT private; nothing is released or charged): the same inputs, polynomial loss,
    network and optimiser with the mechanism switched off, so a report shows that the noise, not the optimiser,
    is what costs the accuracy."""
    return _Releases(np.clip(x, 0.0, 1.0).astype(np.float32), (0.5 - np.eye(classes)[y]).astype(np.float32),
                     np.full(x.shape[1], np.inf))


def _train_on_releases(run: SeedRun, cfg: AdLMConfig, releases: _Releases, method: str, d: int):
    """Train AdLM's network on the released x̄ and φ̄⁽¹⁾ with the polynomial loss (post-processing only), its
    output bias started at the loss's constant minimiser (:func:`constant_output_minimiser`)."""
    task = run.task
    model = build_adlm_net(d, cfg.hidden, task.n_classes)
    with torch.no_grad():
        model[-1].bias.copy_(torch.as_tensor(constant_output_minimiser(releases.phi1), dtype=torch.float32))

    def report(epoch: int, model) -> None:
        print(f"  {method} epoch {epoch + 1}/{cfg.epochs}: test acc "
              f"{accuracy(model, np.clip(task.x_test, 0, 1), task.y_test):.3f}", flush=True)

    return _fit(model, torch.as_tensor(releases.x_bar), torch.as_tensor(releases.phi1), taylor_loss, cfg, run.seed,
                report if run.progress else None)


def train_plain_reference(task, cfg: AdLMConfig | None = None, seed: int = 0) -> torch.nn.Sequential:
    """AdLM's network trained plainly: the yardstick of the noise-free row (NOT private; nothing is charged).

    The records, layers, initialisation, batch order, optimiser and epochs of :func:`train_adlm`'s noise-free
    run at the same ``seed``; only the loss differs: softmax cross-entropy on the clean labels instead of the
    polynomial loss (Eq. 25), and the output bias keeps its default start (cross-entropy is unchanged by a
    shift shared by all classes).

    Args:
        task: the task (its pooled private records, as :func:`train_adlm` selects them).
        cfg: the network and training settings (None = :class:`AdLMConfig`'s defaults).
        seed: the initialisation and the batch order.
    """
    cfg = cfg or AdLMConfig()
    set_seed(seed)
    x, y, _, _ = _private_records(task, cfg)
    model = build_adlm_net(x.shape[1], cfg.hidden, task.n_classes)
    return _fit(model, torch.as_tensor(np.clip(x, 0.0, 1.0)), torch.as_tensor(y), torch.nn.functional.cross_entropy,
                cfg, seed)


def _fit(model, x: torch.Tensor, target: torch.Tensor, loss, cfg: AdLMConfig, seed: int, report=None):
    """Adam at ``cfg.lr`` for ``cfg.epochs`` passes in a seeded order, ``loss(model(x), target)`` per batch."""
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    n = len(x)
    gen = torch.Generator().manual_seed(seed)
    for epoch in range(cfg.epochs):
        model.train()
        order = torch.randperm(n, generator=gen)
        for start in range(0, n, cfg.batch_size):
            idx = order[start:start + cfg.batch_size]
            if len(idx) < 2:
                continue
            opt.zero_grad()
            loss(model(x[idx]), target[idx]).backward()
            opt.step()
        if report is not None:
            report(epoch, model)
    return model
