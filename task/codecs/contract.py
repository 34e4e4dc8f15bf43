"""The contract every codec kind's fitter keeps (:class:`Compressor`), the public data it is fitted on
(:class:`PublicFit`), and :func:`make_compressor`, the fitter a PATE method uses.

Fay, Sjölund & Oechtering, *Private Learning for High-Dimensional Targets with PATE*, Sec. 3-4. A compressor is the
server's side of a codec kind; it lives in the kind's own module beside the hospitals' side (encoder, sensitivity,
verify), and the kind's :class:`task.codecs.core.CodecKind` record names its factory (``compressor``). The server
(``server.pate.plan_release``) asks the compressor, it never tests its name, so a new kind needs no change there:
``fit_release(public: PublicFit, noise_per_sensitivity, teachers)`` fits it on the public data it needs for a release
(``needs_public_model``: the public model's predictions too); ``state()`` (a ``CodecState``) is what the hospitals are
shipped (they encode locally with the kind's encoder); ``batch_state(state, public_probs)`` adds the public side
information one query batch travels with; ``decode_release(z, public_probs, sigma)`` turns noisy mean latents into
probabilities; ``release_checks()`` (e.g. the autoencoder's collapse check) and ``fit_counts`` go on the record;
``sensitivity(teachers)``, ``relation = "replace-one"``, ``latent_dim``, ``bytes_per_query_per_teacher``. Which kind a
PATE method uses is its :class:`task.settings.methods.Method` record's ``codec``. Nothing fitted here may see private data:
everything in a :class:`PublicFit` is public.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from task.codecs.core import check_probabilities, codec_kind, encode, one_hot, row_bound
from task.errors import UserError
from task.learning.phases import timed
from task.settings.methods import methods
from task.options import Relation
from task.settings.presets import Codec


def answering_teachers(teachers: int) -> int:
    """K as an int, at least 1 (a sensitivity is the bound on the mean of K answering teachers' rows)."""
    teachers = int(teachers)
    if teachers < 1:
        raise UserError(f"teachers: expected at least 1 answering teacher, got {teachers}")
    return teachers


@dataclass
class PublicFit:
    """The public data a compressor may be fitted on for one release (nothing in it depends on private data).

    ``reference_maps``: one-hot public reference labels (n, C, *grid); ``reference_probs``: the public model's
    probabilities on those reference scans; ``query_probs``: the public model's probabilities on the public query
    scans (None without a public model); ``reference_is_query``: the reference set *is* the query scans (the paper
    preset); ``with_predictions``: PCA / autoencoder also fit the public model's label maps of the query scans.
    """

    reference_maps: np.ndarray
    reference_probs: np.ndarray | None = None
    query_probs: np.ndarray | None = None
    reference_is_query: bool = False
    with_predictions: bool = True
    #: the public reference scans themselves (the anchored codec's intensity bins are fitted on them)
    reference_scans: np.ndarray | None = None

    def label_maps(self) -> tuple[np.ndarray, dict[str, int]]:
        """The one-hot maps a PCA / autoencoder codec is fitted on (Fay et al. Alg. 1-2 fit on public labels),
        and how many of each kind: the public reference labels (another centre's), and -- ``with_predictions``
        -- the public model's label maps of the public query scans, which come from the hospitals' population,
        so their lesions' positions and shapes are the ones the teachers will describe. Both public
        by construction (tests/test_pate_codec_fit.py)."""
        maps = [np.asarray(self.reference_maps, np.float32)]
        counts = {"public_reference_labels": len(maps[0]), "public_model_on_query_scans": 0}
        # the paper preset's reference set *is* the query scans with their public labels: nothing to add
        if self.with_predictions and self.query_probs is not None and len(self.query_probs) and not self.reference_is_query:
            classes = maps[0].shape[1]
            maps.append(one_hot(np.asarray(self.query_probs).argmax(axis=1), classes))
            counts["public_model_on_query_scans"] = len(maps[1])
        return np.concatenate(maps, axis=0), counts


class Compressor:
    """The server's side of one codec kind (module docstring: the contract ``server.pate`` relies on)."""

    name = "compressor"
    relation = Relation.REPLACE_ONE
    latent_dim: int = 0
    grid: tuple = ()
    classes: int = 4
    #: fit_release needs the public model's predictions (PublicFit.reference_probs / query_probs), and every
    #: query batch and decode needs them as side information
    needs_public_model: bool = False
    #: how many public maps of each kind fit_release fitted on (None: the reference labels alone)
    fit_counts: dict[str, int] | None = None

    def fit_release(self, public: PublicFit, noise_per_sensitivity: float, teachers: int) -> "Compressor":
        """Fit for a release of ``teachers`` answers at ``sigma = noise_per_sensitivity x S``: by default on the
        public reference labels alone (the identity codec learns only their shape)."""
        return self.fit(public.reference_maps)

    def batch_state(self, state: dict, public_probs: np.ndarray | None, scans: np.ndarray | None = None) -> dict:
        """The codec state one query batch is shipped with (default: the state itself); ``public_probs`` and
        ``scans``: the public model's probabilities for the batch's public scans, and the scans."""
        return state

    @timed("decoding")
    def decode_release(self, z: np.ndarray, public_probs: np.ndarray | None, sigma: float,
                       scans: np.ndarray | None = None) -> np.ndarray:
        """Probabilities from noisy mean latents of noise ``sigma`` (default: :meth:`decode`)."""
        return self.decode(z)

    def release_checks(self) -> dict | None:
        """What the record should say about the fitted codec's health (default: nothing)."""
        return None

    def noise_free_decode_key(self) -> str | None:
        """A digest of everything :meth:`decode_release` at ``sigma = 0`` depends on besides the latents, the public
        probabilities and the scans -- so that a comparison may reuse a noise-free decode across its budgets --
        or None when the compressor cannot say (the default: nothing is reused)."""
        return None

    @property
    def bytes_per_query_per_teacher(self) -> int:
        return int(self.latent_dim) * 4

    def fit(self, public_onehot: np.ndarray) -> "Compressor":  # pragma: no cover - interface
        raise NotImplementedError

    def state(self) -> dict:  # pragma: no cover - interface
        raise NotImplementedError

    def decode(self, z: np.ndarray) -> np.ndarray:  # pragma: no cover - interface
        raise NotImplementedError

    def sensitivity(self, teachers: int) -> float:  # pragma: no cover - interface
        raise NotImplementedError

    def row_bound(self) -> float:
        return row_bound(self.state())

    def encode(self, probs: np.ndarray) -> np.ndarray:
        """Server-side convenience (tests, diagnostics): the exact function hospitals run."""
        return encode(self.state(), probs, getattr(self, "device", None))

    def describe(self) -> dict:
        return {"name": self.name, "latent_dim": int(self.latent_dim)}

    def _check_fit_input(self, public_onehot) -> np.ndarray:
        maps = np.asarray(public_onehot, dtype=np.float32)
        if maps.ndim < 3 or len(maps) < 2:
            raise UserError(f"public reference maps: expected (n >= 2, C, *grid), got shape {maps.shape}")
        check_probabilities(maps, "public reference maps")
        self.classes = int(maps.shape[1])
        self.grid = tuple(int(g) for g in maps.shape[2:])
        return maps

    def _base_state(self, kind: str) -> dict:
        return {"kind": np.array(kind), "classes": np.array(self.classes, dtype=np.int64),
                "grid": np.array(self.grid, dtype=np.int64),
                "latent_dim": np.array(int(self.latent_dim), dtype=np.int64)}


def make_compressor(method: str, preset=None, *, seed: int = 0, checkpoint: str | Path | None = None,
                    progress: bool = False, device=None, **options) -> Compressor:
    """The compressor a PATE method uses: the factory of the codec kind its method record names
    (``Method.codec``, :attr:`task.codecs.core.CodecKind.compressor`).

    Args:
        method: a registered method with a codec (``pate-pca``, ``pate-ae``, ``pate-naive``, ``pate-anchored``, ...);
            anything else is a ``UserError``.
        preset: the preset whose codec settings (:class:`task.settings.presets.Codec`) the factory defaults to (PCA
            components, autoencoder latent size and epochs, anchored shells); None = the group's own defaults.
        seed: the autoencoder's training seed (the other codecs ignore it).
        checkpoint: where the autoencoder is checkpointed and, when written for the same data and
            configuration, reused (None = not checkpointed; the other codecs ignore it).
        progress: progress bars while the autoencoder trains.
        device: where the autoencoder runs (``task.learning.device``; None = auto). The other codecs are numpy on the host:
            matrix products of at most a few hundred public rows, and float64 bounding steps the sensitivity
            depends on.
        **options: the factory's own settings (e.g. ``n_components``, ``pca_mode`` / ``sensitivity_mode``,
            ``clip``, ``latent_dim``, ``epochs``, ``shells``, ``clip_scale``); a factory ignores the ones it
            does not use.
    """
    with_codec = {record.name: record.codec for record in methods() if record.codec is not None}
    if method not in with_codec:
        raise UserError(f"method: expected one of {', '.join(with_codec)}, got {method!r}")
    kind = codec_kind(with_codec[method])
    if kind.compressor is None:
        raise UserError(f"method {method}: codec kind {kind.name!r} has no compressor")
    settings = preset.codec if preset is not None else Codec()
    return kind.compressor(settings, seed=seed, checkpoint=checkpoint, progress=progress, device=device, **options)


__all__ = ["Compressor", "PublicFit", "answering_teachers", "make_compressor"]
