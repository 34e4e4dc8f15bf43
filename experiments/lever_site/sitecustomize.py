"""Runs the product itself (``fedpate demo``, ``fedpate compare``) in a world patched by the probe's levers, in every
process it starts: Python imports ``sitecustomize`` at start-up from the path, so

    FEDPATE_WORLD_LEVERS=current+meninges PYTHONPATH=experiments/lever_site:. FEDPATE_CACHE=FOLDER \\
        .venv/bin/fedpate demo --seed 0 --reproducible-noise --real-check DIR --out OUT

generates its phantoms with ``experiments.world_levers.apply`` in place, in the demo's process and in each worker.
FOLDER must be a cache of its own: the phantoms are cached under the generator's version, which the levers leave as
it is. A preview of a candidate generator, not a product setting; unset, this module does nothing. (Generator 7 was
previewed this way as current+compartments+sharp on generator 6, docs/decisions/world-realism.md.)
"""
import os

if os.environ.get("FEDPATE_WORLD_LEVERS"):
    import task.data.phantoms as _phantoms
    from experiments.world_levers import apply as _apply

    _apply(os.environ["FEDPATE_WORLD_LEVERS"], _phantoms)
