"""DP-MAC (Harder, Köhler, Welling & Park 2019, arXiv 1910.06924): private method of auxiliary coordinates.

MAC (Carreira-Perpiñán & Wang 2014; paper eq. 2) adds one auxiliary coordinate vector ``z_{k,n}`` per hidden
layer k and record n, which decouples the nested objective (eq. 1) into per-layer objectives

    output layer:  E_L(W_L) = Σ_n CE(W_L [z_{L-1,n}; 1], y_n)                (classification, paper Sec. 3)
    hidden layer:  E_k(W_k) = μ Σ_n ||z_{k,n} − h(W_k [z_{k-1,n}; 1])||²     (z_0 = x, h = ReLU)

and alternates a Z-step (optimise the z's with W fixed; never released, so non-private — paper Sec. 2.1)
with a W-step. The Z-step descends the *summed* objective: its terms separate over records, so record n's
``z_{k,n}`` depends on record n alone. (Dividing by the batch size |B| — a data-dependent mean — made every
record's z, hence its clipped coefficient, depend on how many other records were sampled: adding one record
then changed all the others' terms and the sum moved by more than C.)

The W-step minimises a Taylor approximation of E_k around the current W_k (Sec. 2.2, eq. 4-5): first order
``E_k(W) ≈ E_k(W⁰) + <c¹_k, W − W⁰>`` (the paper's experiments), optionally with a diagonal second-order
(Gauss-Newton) coefficient ``c²_k``. The data enter only through these coefficients, which are sums over the
batch of per-record terms; the terms of one privacy unit (a record, or all slices of one patient) are summed
and that sum is clipped to norm ``C`` (Sec. 2.2: "bound the sensitivities directly by clipping the norms of
the coefficients"), so under add/remove-one unit the sum of a coefficient has L2 sensitivity ``C``.
Batches are Poisson samples of units (``task.classification`` module note: user-level DP on the slice task).

Appendix I (one Gaussian draw per step): the P coefficient blocks of all layers are each divided by their
sensitivity times √P, concatenated (sensitivity 1), perturbed by ONE draw ``N(0, σ² I)`` and scaled back —
so block p carries noise of std ``σ · C_p · √P``. With Poisson sampling of rate q every step is one
sampled Gaussian mechanism with noise multiplier σ, accounted as ``SampledGaussianEvent(q, σ)`` (moments
accountant, Appendix I "Moments Calculations"; here dp_accounting's PLD through privacy/) under the
**replace-one** relation every method of a comparison uses (docs/PRIVACY.md; a replaced unit moves a block
by at most 2·C_p, which dp_accounting's REPLACE_ONE sampled Gaussian accounts).

Randomness (docs/PRIVACY.md, "Noise"): the DP-PCA noise and, after the planned W-steps are charged, every step's Poisson
batch and Gaussian draw come from named streams of a ``privacy.mechanisms.NoiseSource`` (secure unless a
simulation asks for reproducible noise; ``<prefix>/dp-pca`` and ``<prefix>/w-steps``), each opened only
after its release is in the ledger — never from the training seed: amplification by subsampling needs the
batches to be secret as much as the noise.

Input projection (paper Sec. 3: a 60-dimensional PCA of the inputs, following Abadi et al. 2016). Default
(``pca_basis="public"``): the basis is computed on the task's **public** images alone (the unlabelled query
pool and the labelled reference set; :func:`public_pca`), so no private record reaches it, nothing is charged
for it and the whole budget goes to the W-steps. On mnist5k a DP-PCA at 10 % of ε = 2 over 3,400 records
keeps little more than the first eigenvector above its noise, while 600 public digits give a basis that
captures most of the test images' variance. ``pca_basis="dp"`` keeps DP-PCA for a task without public
images (also the fallback when the task has none):
DP-PCA (paper Sec. 3, following Abadi et al. 2016): each unit's second-moment matrix
``Σ_{n∈unit} x_n x_nᵀ`` clipped to Frobenius norm 1 (for single records: rows clipped to L2 norm 1), their
sum (Frobenius sensitivity 1 under add/remove-one unit, sqrt 2 under replace-one: see ``PCA_SENSITIVITY``)
perturbed with a symmetric Gaussian matrix (Dwork et al. 2014, "Analyze Gauss"), top-k eigenvectors;
accounted as ``GaussianEvent(sensitivity=sqrt 2, sigma, relation="replace-one")`` and composed with the
training steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import torch

from privacy.calibration import calibrate, dpsgd_noise_multiplier
from privacy.events import ComposedEvent, GaussianEvent, SampledGaussianEvent
from privacy.mechanisms import GaussianMechanism, NoiseSource
from task.classification import PrivacyUnit, SeedResult, SeedRun, accuracy, gather_units, set_seed
from task.errors import UserError
from task.learning.dpsgd import poisson_batches
from task.options import Relation, look_up_option


class PcaBasis(StrEnum):
    """Where DP-MAC's input projection comes from (module note)."""
    PUBLIC = "public"   # a PCA of the task's public images: free
    DP = "dp"           # DP-PCA of the private records: charged


@dataclass(frozen=True)
class DPMACConfig:
    hidden: tuple[int, ...] = (300,)   # paper's classifier: one hidden layer of 300 units
    epochs: int = 10
    batch_size: int = 250              # expected (Poisson) batch size in units; q = batch_size / units
    lr: float = 0.01                   # Adam on the W-step (paper, Appendix B table)
    lr_decay: float = 0.95             # per epoch
    z_steps: int = 10
    z_lr: float = 0.1                  # per-record step on the summed Z-step objective (μ = 1: 0.5 jumps onto h)
    mu: float = 1.0                    # quadratic-penalty weight of MAC
    clip: float = 1.0                  # per-record clip of every first-order coefficient block
    clip2: float = 1.0                 # per-record clip of the second-order blocks (order == 2)
    order: int = 1                     # 1 = linear Taylor approximation (paper's experiments), 2 = + diag
    newton_lr: float = 0.5
    damping: float = 1.0
    pca_components: int | None = 60    # None = no PCA projection
    pca_basis: PcaBasis = PcaBasis.PUBLIC   # PCA of the public images (free), or DP-PCA on the private records
    pca_epsilon_fraction: float = 0.1  # share of ε spent on DP-PCA (pca_basis="dp" only; gdp-exact)
    noise_multiplier: float | None = None   # None = calibrate for the target ε
    accountant: str = "pld"

    def __post_init__(self) -> None:
        object.__setattr__(self, "pca_basis", look_up_option(self.pca_basis, PcaBasis, "dp-mac: pca_basis"))
        object.__setattr__(self, "hidden", tuple(self.hidden))
        if self.order not in (1, 2):
            raise UserError(f"dp-mac: order must be 1 (first-order Taylor coefficients) or 2, got {self.order}")
        if self.epochs < 1 or self.batch_size <= 0:
            raise UserError(f"dp-mac: expected epochs >= 1 and a positive batch size, got {self.epochs}, "
                            f"{self.batch_size}")
        if not (self.clip > 0 and self.clip2 > 0):
            raise UserError(f"dp-mac: expected positive clips, got clip={self.clip}, clip2={self.clip2}")
        if not 0 < self.pca_epsilon_fraction < 1:
            raise UserError(f"dp-mac: pca_epsilon_fraction must be in (0, 1), got {self.pca_epsilon_fraction}")


# --------------------------------------------------------------------------------------------- maths
def clip_factors(norms: torch.Tensor, clip: float) -> torch.Tensor:
    """``min(1, C / ||c_n||)``: scaling that bounds every per-unit coefficient by C (paper Sec. 2.2)."""
    return torch.clamp(clip / (norms + 1e-12), max=1.0)


def unit_norms(u: torch.Tensor, v: torch.Tensor, groups: torch.Tensor | None) -> torch.Tensor:
    """Frobenius norms of the per-unit coefficient sums ``Σ_{n∈g} u_n v_nᵀ``, without forming them:
    ``||Σ u_n v_nᵀ||_F² = Σ_{n,m∈g} (u_n·u_m)(v_n·v_m)``. ``groups=None``: every row is its own unit
    (``||u_n||·||v_n||``); else ``groups[n]`` is row n's unit index (0..G−1)."""
    if groups is None:
        return u.norm(dim=1) * v.norm(dim=1)
    same = (groups[:, None] == groups[None, :]).to(u.dtype)
    per_row = ((u @ u.T) * (v @ v.T) * same).sum(dim=1)
    squares = torch.zeros(int(groups.max()) + 1, dtype=u.dtype).index_add_(0, groups, per_row)
    return squares.clamp(min=0.0).sqrt()


def layer_coefficients(weight: torch.Tensor, bias: torch.Tensor, z_prev: torch.Tensor, z_target: torch.Tensor | None,
                       labels: torch.Tensor | None, cfg: DPMACConfig, groups: torch.Tensor | None = None):
    """Clipped per-layer Taylor coefficients summed over the batch (paper eq. 4-5, Sec. 2.2).

    Every per-record first-order coefficient is an outer product ``u_n v_nᵀ`` with ``v_n = [z_{k-1,n}; 1]``
    (so clipping needs no per-record matrices, see ``unit_norms``); the terms of one unit (``groups``: row →
    unit index; None = one unit per row) are summed, then clipped:
      hidden (MSE, ReLU):  u_n = −2μ (z_{k,n} − h(a_n)) ⊙ h'(a_n)
      output (softmax CE): u_n = softmax(a_n) − onehot(y_n)
    Second-order diagonal (Gauss-Newton) coefficient: ``u'_n (v_n²)ᵀ`` with u'_n = 2μ h'(a_n) (hidden) or
    p(1−p) (output).

    Returns ``(sums, per_unit_norms_after_clipping)``: ``sums`` is a list of (out, in+1) tensors — the
    first-order block, then (order 2) the second-order block — each with add/remove-one-unit sensitivity
    ≤ its clip.

    Args:
        weight / bias: the layer's current parameters W_k (out, in) and b_k (out,), the Taylor expansion point.
        z_prev: (n, in) the layer's inputs z_{k-1} (the projected records for the first layer).
        z_target: (n, out) the auxiliary coordinates z_k the hidden layer's output is fitted to (None for the
            output layer).
        labels: (n,) integer labels for the output layer (None for a hidden layer).
        cfg: MAC's quadratic-penalty weight μ (``mu``, hidden layers), the clip C of every unit's first-order
            coefficient (``clip``), the order (1 = first-order coefficients only, the paper's experiments; 2 = also
            the diagonal second-order block) and the clip of every unit's second-order coefficient (``clip2``,
            order 2 only).
        groups: row -> unit index within the batch; None = one unit per row.
    """
    mu, clip, order, clip2 = cfg.mu, cfg.clip, cfg.order, cfg.clip2
    v = torch.cat([z_prev, torch.ones(z_prev.shape[0], 1, dtype=z_prev.dtype)], dim=1)
    a = v @ torch.cat([weight, bias[:, None]], dim=1).T
    if labels is None:       # hidden layer
        active = (a > 0).to(a.dtype)
        u = -2.0 * mu * (z_target - torch.relu(a)) * active
        u2 = 2.0 * mu * active
    else:                    # output layer
        p = torch.softmax(a, dim=1)
        u = p - torch.nn.functional.one_hot(labels, p.shape[1]).to(p.dtype)
        u2 = p * (1 - p)
    rows = slice(None) if groups is None else groups      # a unit's clip factor applies to all its rows
    norms = unit_norms(u, v, groups)
    f = clip_factors(norms, clip)
    sums = [(u * f[rows][:, None]).T @ v]
    clipped = [norms * f]
    if order == 2:
        v2 = v * v
        norms2 = unit_norms(u2, v2, groups)
        f2 = clip_factors(norms2, clip2)
        sums.append((u2 * f2[rows][:, None]).T @ v2)
        clipped.append(norms2 * f2)
    return sums, clipped


def perturb_concatenated(blocks: list[torch.Tensor], sensitivities: list[float], sigma: float, mechanism_factory,
                         ) -> list[torch.Tensor]:
    """Appendix I: scale block p by ``1/(S_p √P)``, concatenate (L2 sensitivity 1), add ONE Gaussian draw
    of std σ, scale back by ``S_p √P``. Block p thus gets noise of std ``σ S_p √P``.

    ``mechanism_factory(sigma)`` returns a callable adding ``N(0, σ² I)`` (privacy.mechanisms.GaussianMechanism)
    — it is called exactly once per step.
    """
    P = len(blocks)
    scales = [s * math.sqrt(P) for s in sensitivities]
    flat = torch.cat([(b / sc).reshape(-1) for b, sc in zip(blocks, scales)])
    noisy = torch.as_tensor(mechanism_factory(sigma)(flat), dtype=flat.dtype)
    out, start = [], 0
    for b, sc in zip(blocks, scales):
        out.append(noisy[start:start + b.numel()].reshape(b.shape) * sc)
        start += b.numel()
    return out


def clipped_second_moment(x: np.ndarray, units: list[np.ndarray]) -> np.ndarray:
    """``Σ_g M_g / max(1, ||M_g||_F)`` over ``units`` (record indices into x), ``M_g = Σ_{n∈g} x_n x_nᵀ``:
    Frobenius sensitivity 1 under add/remove-one unit. Computed as ``X̃ᵀX̃`` with unit g's rows scaled by
    ``max(1, ||M_g||_F)^{-1/2}`` (``||M_g||_F = ||X_g X_gᵀ||_F``); a single record is the usual row clip
    to L2 norm 1."""
    x = np.asarray(x, np.float64)
    parts = [x[records] / math.sqrt(max(1.0, float(np.linalg.norm(x[records] @ x[records].T)))) for records in units]
    xc = np.concatenate(parts) if parts else np.zeros((0, x.shape[1]))
    return xc.T @ xc


def public_images(task) -> np.ndarray:
    """The task's public images: the unlabelled query pool and the labelled reference set (never a private
    record)."""
    parts = [np.asarray(a, np.float32) for a in (task.x_query, task.x_reference) if len(a)]
    return np.concatenate(parts) if parts else np.zeros((0, task.input_dim), np.float32)


def public_pca(x_public: np.ndarray, components: int) -> np.ndarray:
    """Top-``components`` right singular vectors (d, k) of the public images, rows scaled to L2 norm ≤ 1: the
    uncentred second moment that DP-PCA (:func:`dp_pca`) estimates, here exactly, since the images are
    public. A function of ``x_public`` alone; nothing is charged."""
    x = np.asarray(x_public, np.float64)
    x = x / np.maximum(1.0, np.linalg.norm(x, axis=1, keepdims=True))
    _, _, vt = np.linalg.svd(x, full_matrices=False)
    return vt[:components].T.astype(np.float32)


def dp_pca(x: np.ndarray, components: int, sigma: float, mechanism_factory,
           units: list[np.ndarray] | None = None) -> np.ndarray:
    """Analyze-Gauss DP-PCA (Dwork, Talwar, Thakurta & Zhang 2014) as used by Abadi et al. / DP-MAC Sec. 3.

    ``A = clipped_second_moment(x, units)`` (units default: one per record) has Frobenius (hence
    upper-triangle L2) sensitivity 1 under add/remove-one unit. The upper triangle gets N(0, σ²) noise (one
    mechanism call) and is mirrored; returns the top-``components`` eigenvectors (d, k).
    """
    a = clipped_second_moment(x, units if units is not None else list(np.arange(len(x))[:, None]))
    d = a.shape[0]
    iu = np.triu_indices(d)
    upper = mechanism_factory(sigma)(a[iu].astype(np.float64))
    noisy = np.zeros_like(a, dtype=np.float64)
    noisy[iu] = upper
    noisy = noisy + np.triu(noisy, 1).T
    vals, vecs = np.linalg.eigh(noisy)
    return vecs[:, np.argsort(vals)[::-1][:components]].astype(np.float32)


# --------------------------------------------------------------------------------------------- training
class MACNet(torch.nn.Module):
    def __init__(self, dims: list[int], projection: np.ndarray | None = None):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.register_buffer("projection", None if projection is None else torch.as_tensor(projection))

    def project(self, x):
        return x if self.projection is None else x @ self.projection

    def activations(self, x):
        zs = [self.project(x)]
        for i, layer in enumerate(self.layers):
            a = layer(zs[-1])
            zs.append(a if i == len(self.layers) - 1 else torch.relu(a))
        return zs

    def forward(self, x):
        return self.activations(x)[-1]


def z_step(net: MACNet, x: torch.Tensor, y: torch.Tensor, cfg: DPMACConfig) -> list[torch.Tensor]:
    """Initialise the auxiliary coordinates by a forward pass (paper Sec. 3) and refine them by gradient
    steps on the MAC objective (eq. 2) with W fixed. Returns [z_0 = projected x, z_1, ..., z_{L-1}].

    The objective is the sum over records (no division by the batch size): each record's z then follows
    from that record alone, which the W-step's add/remove sensitivity C (Sec. 2.2) relies on."""
    with torch.no_grad():
        zs = net.activations(x)[:-1]
    hidden = [z.clone().requires_grad_(True) for z in zs[1:]]
    if hidden and cfg.z_steps > 0:
        opt = torch.optim.SGD(hidden, lr=cfg.z_lr)
        layers = list(net.layers)
        for _ in range(cfg.z_steps):
            opt.zero_grad()
            prev = [zs[0]] + hidden
            loss = torch.nn.functional.cross_entropy(layers[-1](prev[-1]), y, reduction="sum")
            for k in range(len(hidden)):
                loss = loss + cfg.mu * ((hidden[k] - torch.relu(layers[k](prev[k]))) ** 2).sum()
            loss.backward()
            with torch.no_grad():
                for layer in layers:
                    for p in layer.parameters():
                        p.grad = None
            opt.step()
    return [zs[0]] + [h.detach() for h in hidden]


def w_step_coefficients(net: MACNet, x: torch.Tensor, y: torch.Tensor, cfg: DPMACConfig,
                        groups: torch.Tensor | None = None) -> tuple[list[torch.Tensor], list[float]]:
    """The data-dependent part of one W-step on a sampled batch: the Z-step, then every layer's clipped
    coefficient sums (eq. 4-5, Sec. 2.2), in the order Appendix I concatenates them.

    ``groups``: each row's unit index within the batch (a patient's slices share one; None = one unit per
    row). Returns ``(blocks, sensitivities)``: per layer the first-order block (and, order 2, the
    second-order block); adding or removing one unit changes block p by at most ``sensitivities[p]`` (L2).
    An empty batch gives zero blocks (the step still releases noise).
    """
    layers = list(net.layers)
    zs = z_step(net, x, y, cfg) if len(y) else None
    blocks, sens = [], []
    for k, layer in enumerate(layers):
        if zs is None:
            out_dim, in_dim = layer.weight.shape
            sums = [torch.zeros(out_dim, in_dim + 1) for _ in range(cfg.order)]
        else:
            last = k == len(layers) - 1
            sums, _ = layer_coefficients(layer.weight.detach(), layer.bias.detach(), zs[k],
                                         None if last else zs[k + 1], y if last else None, cfg, groups)
        blocks += sums
        sens += [cfg.clip, cfg.clip2][:cfg.order]
    return blocks, sens


#: One relation for every method of a comparison (docs/PRIVACY.md): replace-one, the only one that holds
#: once dataset sizes are published. A unit's clipped W-step term moves the sum by at most 2C when it is
#: replaced (its term and its replacement's, each of norm <= C): dp_accounting's REPLACE_ONE sampled
#: Gaussian accounts that with the multiplier relative to C.
RELATION = Relation.REPLACE_ONE
#: DP-PCA's second-moment matrix under replace-one: one unit's moment (PSD, Frobenius norm <= 1) is
#: replaced by another, ||A - B||_F^2 = ||A||^2 + ||B||^2 - 2<A, B> <= 2 since <A, B> >= 0 for PSD
#: matrices; the upper triangle that gets the noise has at most that norm.
PCA_SENSITIVITY = 2 ** 0.5


def calibrate_dpmac(epsilon: float, delta: float, sampling_rate: float, steps: int, pca_sigma: float | None,
                    accountant: str = "pld") -> float:
    """Noise multiplier σ such that [DP-PCA Gaussian] ∘ ``steps`` × SampledGaussian(q, σ) spends ``epsilon``
    under replace-one (PLD; dp_accounting's RDP has no replace-one Poisson subsampling).

    Args:
        epsilon / delta: the target (ε, δ) of DP-PCA and all W-steps together.
        sampling_rate: the Poisson sampling rate q of the units.
        steps: the number of W-steps.
        pca_sigma: the DP-PCA release's σ (None = no DP-PCA: the W-steps alone spend ``epsilon``).
        accountant: the accountant of the final search (``pld``, the default; an RDP locator brackets it).
    """

    if pca_sigma is None:
        return dpsgd_noise_multiplier(epsilon, delta, sampling_rate, steps, accountant=accountant, relation=RELATION)
    pca_event = GaussianEvent(sensitivity=PCA_SENSITIVITY, sigma=pca_sigma, relation=RELATION)
    make = lambda z: ComposedEvent((pca_event, SampledGaussianEvent(sampling_rate, z, steps,  # noqa: E731
                                                                    relation=RELATION)))
    # A fast RDP locator on the add/remove reading of the same steps gives a lower end (replace-one needs
    # more noise); PLD then searches a bracket above it (calibrate widens it when it has to).
    rough = lambda z: ComposedEvent((GaussianEvent(PCA_SENSITIVITY, pca_sigma,  # noqa: E731
                                                   relation=Relation.ADD_REMOVE),
                                     SampledGaussianEvent(sampling_rate, z, steps)))
    guess = calibrate(rough, epsilon, delta, "rdp", 0.3, 3.0, rtol=1e-2)
    return calibrate(make, epsilon, delta, accountant, 0.9 * guess, 1.6 * guess)


def pca_sigma_for(epsilon: float, delta: float) -> float:
    return calibrate(lambda s: GaussianEvent(sensitivity=PCA_SENSITIVITY, sigma=s, relation=RELATION),
                     epsilon, delta, "gdp-exact", 0.01, 1e4)


def train_dpmac(run: SeedRun, cfg: DPMACConfig | None = None) -> SeedResult:
    """Train a DP-MAC classifier on the pooled private records, sampled and clipped per privacy unit
    (``task.unit_records()``: a record, or a patient's slices).

    Args:
        run: the task, the budget of DP-PCA and the W-steps together (``run.epsilon`` None runs MAC without noise,
            nothing charged), the guard and owners they are charged to first, ``run.seed`` (only initialises the
            network: the batches and noise come from ``run.noise``), and the prefix of the release ids
            (``<prefix>/dp-pca``, ``<prefix>/w-steps``; default ``dp-mac``), which also name the noise streams.
            ``run.progress`` prints the test accuracy after every epoch.
        cfg: the network, training, clipping and DP-PCA settings (None = :class:`DPMACConfig`'s defaults);
            ``cfg.noise_multiplier`` None = calibrated to ``run.epsilon`` (:func:`calibrate_dpmac`).
    """

    cfg = cfg or DPMACConfig()
    noise = run.noise if run.noise is not None else NoiseSource()
    prefix = run.prefix("dp-mac")
    task = run.task
    set_seed(run.seed)
    x = np.asarray(task.x_private, np.float32)
    units = task.unit_records()
    n = len(units)
    q = min(1.0, cfg.batch_size / n)
    steps_per_epoch = max(1, int(round(1.0 / q)))
    total_steps = steps_per_epoch * cfg.epochs

    projection, pca_sigma, basis = _input_projection(run, cfg, units, noise, prefix)
    noise_multiplier = None
    if run.private:   # calibrate slightly below the budget: the ledger composes per-epoch events on its own PLD grid
        noise_multiplier = cfg.noise_multiplier or calibrate_dpmac(0.995 * run.epsilon, run.delta, q, total_steps,
                                                                   pca_sigma, cfg.accountant)

    in_dim = cfg.pca_components or x.shape[1]
    net = MACNet([in_dim, *cfg.hidden, task.n_classes], projection)
    _w_steps(run, cfg, net, _Sampling(units, q, steps_per_epoch), noise_multiplier, noise.generator, prefix)
    return SeedResult(
        method="dp-mac", accuracy=accuracy(net, task.x_test, task.y_test), epsilon_budget=run.epsilon,
        delta=run.delta, relation=RELATION if run.private else None, sigma=noise_multiplier,
        details={"noise_multiplier": noise_multiplier, "sampling_rate": q, "steps": total_steps,
                 "privacy_unit": task.privacy_unit, "units": n,
                 "epochs": cfg.epochs, "order": cfg.order, "clip": cfg.clip, "hidden": list(cfg.hidden),
                 "pca_components": cfg.pca_components, "pca_basis": basis, "pca_sigma": pca_sigma,
                 "noise_std_per_block": None if noise_multiplier is None else
                 noise_multiplier * cfg.clip * math.sqrt(cfg.order * len(net.layers))},
        model=net,
    )


def _input_projection(run: SeedRun, cfg: DPMACConfig, units: list[np.ndarray], noise, prefix: str):
    """The input projection (paper Sec. 3): ``(projection (d, k) or None, DP-PCA's σ or None, the basis used)``.

    A PCA of the public images when ``cfg.pca_basis`` is public and there are at least as many public images as
    components (free); otherwise DP-PCA of the private records, charged to the ledger (``<prefix>/dp-pca``)
    before its stream is opened -- or, without a budget, the plain PCA of the private records.
    """
    if not cfg.pca_components:
        return None, None, None
    task = run.task
    x = np.asarray(task.x_private, np.float32)
    x_public = public_images(task)
    public = cfg.pca_basis is PcaBasis.PUBLIC and len(x_public) >= cfg.pca_components
    basis = PcaBasis.PUBLIC if public else PcaBasis.DP
    if public:
        return public_pca(x_public, cfg.pca_components), None, basis
    if not run.private:
        u, s, vt = np.linalg.svd(x / np.maximum(1.0, np.linalg.norm(x, axis=1, keepdims=True)), full_matrices=False)
        return vt[:cfg.pca_components].T.astype(np.float32), None, basis
    pca_sigma = pca_sigma_for(cfg.pca_epsilon_fraction * run.epsilon, run.delta)
    release = f"{prefix}/dp-pca"
    run.guard.charge(run.owners, GaussianEvent(sensitivity=PCA_SENSITIVITY, sigma=pca_sigma, relation=RELATION),
                     release_id=release, note={"components": cfg.pca_components})
    stream = noise.generator(release)          # opened after the charge
    projection = dp_pca(x, cfg.pca_components, pca_sigma, lambda s: GaussianMechanism(s, stream), units)
    return projection, pca_sigma, basis


@dataclass(frozen=True)
class _Sampling:
    """Poisson sampling of the privacy units: ``rate`` q per step, ``steps_per_epoch`` ≈ 1/q steps an epoch."""

    units: list
    rate: float
    steps_per_epoch: int


def _w_steps(run: SeedRun, cfg: DPMACConfig, net: MACNet, sampling: _Sampling, noise_multiplier: float | None,
             open_stream, prefix: str) -> None:
    """Every epoch's W-steps (Sec. 2.2, Appendix I) on Poisson samples of the units. With a budget, all planned
    steps are charged (``<prefix>/w-steps``, one guard check) before the stream of their batches and noise is
    opened (``open_stream(release)``), and every step releases noise, an empty batch too (the sampled
    Gaussian's analysis)."""
    task = run.task
    per_record = task.privacy_unit is PrivacyUnit.RECORD      # one record per unit: the cheap clipping path
    xt = torch.as_tensor(np.asarray(task.x_private, np.float32))
    yt = torch.as_tensor(np.asarray(task.y_private, np.int64))
    n, q = len(sampling.units), sampling.rate
    total_steps = sampling.steps_per_epoch * cfg.epochs
    opt = torch.optim.Adam(net.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=cfg.lr_decay)
    release = f"{prefix}/w-steps"
    if run.private:   # charge all planned W-steps before any of their batches or noise is drawn (one guard check)
        run.guard.charge(run.owners, SampledGaussianEvent(q, noise_multiplier, total_steps, relation=RELATION),
                         release_id=release,
                         note={"steps": total_steps, "order": cfg.order, "clip": cfg.clip, "epochs": cfg.epochs})
    stream = open_stream(release)      # Poisson batches and the steps' noise (opened after the charge)
    batches = poisson_batches(n, q, total_steps, stream)      # Poisson sampling of units
    for epoch in range(cfg.epochs):
        for _ in range(sampling.steps_per_epoch):
            idx, groups = gather_units(sampling.units, next(batches))
            blocks, sens = w_step_coefficients(net, xt[idx], yt[idx], cfg,
                                               None if per_record else torch.from_numpy(groups))
            if run.private:   # every step releases noise, an empty batch too (the sampled Gaussian's analysis)
                blocks = perturb_concatenated(blocks, sens, noise_multiplier,
                                              lambda s: GaussianMechanism(s, stream))
            _apply_w_step(net, blocks, cfg, opt, q * n)
        sched.step()
        if run.progress:
            print(f"  dp-mac epoch {epoch + 1}/{cfg.epochs}: test acc {accuracy(net, task.x_test, task.y_test):.3f}",
                  flush=True)


def _apply_w_step(net: MACNet, blocks: list[torch.Tensor], cfg: DPMACConfig, opt, denom: float) -> None:
    """One W-step from the (noisy) coefficient sums, divided by the *expected* batch size ``denom`` (fixed: the
    sum, not a data-dependent mean, is private): an Adam step on the first-order blocks (order 1), or a damped
    diagonal Newton step (order 2)."""
    opt.zero_grad()
    for k, layer in enumerate(net.layers):
        g = blocks[k * cfg.order] / denom
        if cfg.order == 1:
            layer.weight.grad = g[:, :-1].clone()
            layer.bias.grad = g[:, -1].clone()
        else:
            h = torch.clamp(blocks[k * cfg.order + 1] / denom, min=0.0) + cfg.damping
            with torch.no_grad():
                step = cfg.newton_lr * g / h
                layer.weight -= step[:, :-1]
                layer.bias -= step[:, -1]
    if cfg.order == 1:
        opt.step()
