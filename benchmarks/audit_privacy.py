"""Empirical privacy audit (docs/PRIVACY_AUDIT.md): claimed ε (from the ledger) beside a 95 % lower bound on the real
ε.

    PYTHONPATH=. .venv/bin/python benchmarks/audit_privacy.py [--quick] [--out audit.json]

For the PATE aggregator (K=128 teachers over 4 hospitals, N=40 queries, δ=1e-3, ε ∈ {1, 8}; σ calibrated
as ``server.pate`` does, from the verified codec state) with the anchored codec (the demo's
``pate-anchored``: the product's compressor and defaults, C fitted on public maps, a public anchor per
query, each shell split into the quick preset's T1-Gd bins unless ``--anchored-bins`` says otherwise) -- and, in the full run, PCA clipped at C=1 -- and for DP-SGD (``task.learning.training.train_segmentation``
with a ``DPConfig``: ε=2, δ=1e-3, Poisson rate 1/4, 20 steps, per-layer clipping) under both relations it
can claim -- replace-one (the default: the canary against a record whose gradient points the other way)
and add-remove (the canary against its absence) -- runs the product's own mechanism on worst-case
neighbouring inputs many times, scores each run with the optimal likelihood-ratio statistic and prints
the Clopper-Pearson lower bound on ε (threshold chosen on held-out runs; ``sim/runners/privacy_audit.py``
and ``privacy/audit.py`` explain the method: Jagielski et al. 2020, Nasr et al. 2021). Each mechanism
appears twice: "product" (every run through ``Hospital.answer_query`` + ``aggregate_query`` /
``train_segmentation`` with a fresh ledger and guard, noise from the secure ``NoiseSource`` unless ``--seed``) and "vectorised" (the same releases drawn
by numpy a million times per side; ``tests/test_privacy_audit.py`` checks they match the product's).
Broken controls must come out above their claim: PATE with ``codec_sensitivity`` understated 4x (the one
function calibration and every ledger use, patched for that run only); DP-SGD with a quarter of the
noise, and without clipping, under each relation.

The secure sums (``sim/runners/privacy_audit.py``, "secure sums"): one secure PATE query (the anchored codec,
K=6 teachers over 3 hospitals) and one dp-fedavg-secure step (the voxel head's 213 coordinates, 6 patients over 3
hospitals), each at ``--secure-epsilon`` (default 1), each release a full ``server.secure.secure_sum`` of the
hospitals' real ``SecureHospital`` parties -- each checks the server's plan, charges its ledger, re-clips and
conditionally rounds its rows onto the declared grid and adds its own exact discrete Gaussian share. The audited
row is ``+C u`` in D and ``-C u`` in D'; the adversary projects the unmasked sum on u. Broken control: every
hospital's noise share drawn with a twentieth of the standard deviation it declared and charged. Product path only
(the rounding and the sampler are the product's own code, run by run).

The "perfect-test limit" column is ε(δ) of the pair actually run (PATE: its exact μ-GDP curve; DP-SGD:
the PLD of the pair under its relation): what the bound would approach with unlimited runs; for an
honest mechanism it is the claim. "ceiling at these runs" is the bound an error-free test would give
with that many held-out runs: a claim above it cannot be refuted by that row.

Runtime and results: docs/PRIVACY_AUDIT.md (``--quick``: fewer runs, looser bounds).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer runs (a few minutes; looser bounds)")
    parser.add_argument("--pate-runs", type=int, default=None, help="product-path runs per side (default 600)")
    parser.add_argument("--dpsgd-runs", type=int, default=None, help="product-path runs per side (default 400)")
    parser.add_argument("--vectorised", type=int, default=None, help="vectorised runs per side (default 1e6)")
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 8.0], help="PATE budgets")
    parser.add_argument("--codecs", nargs="+", default=None, choices=["anchored", "pca"],
                        help="PATE codecs to audit (default: anchored and pca; --quick: anchored)")
    parser.add_argument("--anchored-bins", type=int, default=None,
                        help="intensity bins per shell of the anchored codec (default: the quick preset's)")
    parser.add_argument("--dpsgd-epsilon", type=float, default=2.0)
    parser.add_argument("--delta", type=float, default=1e-3)
    parser.add_argument("--teachers", type=int, default=128)
    parser.add_argument("--hospitals", type=int, default=4)
    parser.add_argument("--queries", type=int, default=40)
    parser.add_argument("--secure-runs", type=int, default=None,
                        help="product-path releases per side of each secure-sum row (default 300; --quick: 100)")
    parser.add_argument("--secure-epsilon", type=float, default=1.0,
                        help="the budget one secure PATE query / one dp-fedavg-secure step is calibrated to")
    parser.add_argument("--seed", type=int, default=None,
                        help="reproducible noise streams for the product runs (default: the secure source)")
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from privacy.mechanisms import NoiseSource
    from sim.runners.privacy_audit import (DPSGDAudit, PateAudit, SecureAudit, audit_dpsgd, audit_failures,
                                           audit_pate, audit_secure, dpsgd_setup, format_table, pate_setup,
                                           secure_fedavg_setup, secure_pate_setup)

    pate_runs = args.pate_runs if args.pate_runs is not None else (200 if args.quick else 600)
    dpsgd_runs = args.dpsgd_runs if args.dpsgd_runs is not None else (100 if args.quick else 400)
    vectorised = args.vectorised if args.vectorised is not None else (200_000 if args.quick else 1_000_000)
    broken_runs = max(100, pate_runs // 2)
    secure_runs = args.secure_runs if args.secure_runs is not None else (100 if args.quick else 300)
    pate_codecs = args.codecs or (["anchored"] if args.quick else ["anchored", "pca"])
    from task.settings.presets import get_preset

    bins = args.anchored_bins or get_preset("quick").codec.anchored_intensity_bins
    noise = NoiseSource.reproducible(args.seed) if args.seed is not None else None
    seed = args.seed or 0
    started, cpu_started = time.perf_counter(), time.process_time()
    rows, hospital_eps, sigmas, codec_notes = [], [], {}, {}

    def show(new):
        rows.extend(new)
        for r in new:
            print(f"  {r.mechanism} ({r.path}, {r.trials:,} runs/side): claimed ε {r.claimed_epsilon:.4g}, "
                  f"lower bound {r.bound.epsilon_lower:.3f} [{r.seconds:.0f} s]", file=sys.stderr, flush=True)

    def streams(*names):          # independent reproducible streams per row (None: the secure source)
        return noise.child(*names) if noise is not None else None

    for codec in pate_codecs:
        for epsilon in args.epsilons:
            for broken in (None, 4.0):
                setup = pate_setup(PateAudit(epsilon, args.delta, codec=codec, teachers=args.teachers,
                                             hospitals=args.hospitals, queries=args.queries, seed=seed,
                                             broken_factor=broken,
                                             **({"intensity_bins": bins} if codec == "anchored" else {})))
                show(audit_pate(setup, broken_runs if broken else pate_runs, vectorised_trials=vectorised,
                                noise=streams("pate", codec, epsilon, broken or 1), seed=seed))
                hospital_eps.extend(setup.hospital_epsilon.values())     # audit_pate: equal to the server's
                grid = "x".join(map(str, setup.anchors.shape[2:])) if setup.anchors is not None else "4x4x4"
                codec_notes[codec] = (f"{codec}: l={setup.latent_dim}, C={setup.clip:.4g}"
                                      + (f" (2.5 x the public model's median residual), shells "
                                         f"{setup.compressor.shells} x {bins} T1-Gd bins, grid {grid}"
                                         if codec == "anchored" else
                                         f", grid {grid}"))

    for relation in ("replace-one", "add-remove"):
        real = dpsgd_setup(DPSGDAudit(args.dpsgd_epsilon, args.delta, relation=relation))   # target mode: DPSession calibrates σ
        sigmas[relation] = real
        show(audit_dpsgd(real, dpsgd_runs, vectorised_trials=vectorised, noise=streams("dpsgd", relation),
                         seed=seed, limit=True))
        quarter = dpsgd_setup(DPSGDAudit(args.dpsgd_epsilon, args.delta, relation=relation, noise_factor=0.25),
                              sigma=real.sigma)
        show(audit_dpsgd(quarter, max(100, dpsgd_runs // 2), vectorised_trials=vectorised,
                         noise=streams("dpsgd", relation, "quarter"), seed=seed, limit=True))
        unclipped = dpsgd_setup(DPSGDAudit(args.dpsgd_epsilon, args.delta, relation=relation, unclipped=True),
                                sigma=real.sigma)
        show(audit_dpsgd(unclipped, 100, noise=streams("dpsgd", relation, "unclipped"), seed=seed))

    # the secure sums: one release each, through the hospitals' own rounding and discrete Gaussian shares
    import tempfile

    secure_notes = []
    with tempfile.TemporaryDirectory() as workdir:
        for name, make in (("pate", secure_pate_setup), ("dp-fedavg", secure_fedavg_setup)):
            for broken in (None, 20.0):
                setup = make(SecureAudit(args.secure_epsilon, args.delta, broken_factor=broken, seed=seed,
                                         **({"intensity_bins": bins} if name == "pate" else {})),
                             Path(workdir) / f"{name}-{broken or 1}")
                show(audit_secure(setup, secure_runs, seed=seed, noise_seed=args.seed))
                if broken is None:
                    secure_notes.append(f"{setup.mechanism}: {setup.length} coordinates, threshold {setup.threshold}, "
                                        f"2^{setup.bits} modulus, declared noise sd {setup.noise_sd:.4g} grid units")

    seconds = time.perf_counter() - started
    print()
    print(format_table(rows))
    print()
    dpsgd_note = "; ".join(f"{rel}: sigma={setup.sigma:.4f}" for rel, setup in sigmas.items())
    real = next(iter(sigmas.values()))
    print(f"DP-SGD: {dpsgd_note} (each calibrated by train_segmentation's DPSession in target mode under its "
          f"relation), q={real.sampling_rate:g}, {real.steps} steps, per-layer clip C={real.clip:g} on 2 tensors. "
          f"PATE ({'; '.join(codec_notes.values())}): sigma from pate_sigma (exact GDP) at "
          f"S = codec_sensitivity(verified state, K) = 2C/K; "
          f"{len(hospital_eps)} hospital ledgers (each charged by its hospital, through Hospital.answer_query) "
          f"claimed the server ledger's epsilon in every PATE row. Secure sums ({'; '.join(secure_notes)}): every "
          f"release a full secure sum of the hospitals' SecureHospital parties, each hospital charging its ledger "
          f"before drawing its share; the audited hospital's ledger claimed the server plan's epsilon in every run. "
          f"Lower bounds at 95% confidence "
          f"(Clopper-Pearson, each rate at 97.5%, threshold chosen on the other half of the runs). Noise: "
          f"{'reproducible (seed given)' if noise is not None else 'secure (OS CSPRNG)'} for product runs. "
          f"Total {seconds:.0f} s wall, {time.process_time() - cpu_started:.0f} s CPU.")
    if args.out:
        Path(args.out).write_text(json.dumps([
            {"mechanism": r.mechanism, "claimed_epsilon": r.claimed_epsilon, "delta": r.delta, "path": r.path,
             "runs_per_side": r.trials, "broken": r.broken, "limit": r.limit, "seconds": r.seconds,
             **{f"bound_{k}": v for k, v in r.bound.to_dict().items()}} for r in rows], indent=2))
    failures = audit_failures(rows)
    for problem in failures:
        print(f"FAILED: {problem}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
