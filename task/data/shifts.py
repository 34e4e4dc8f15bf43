"""Names of the held-out phantom regimes (``fedpate data phantoms --shift``), docs/GENERALISATION.md.

Kept apart from :mod:`task.data.phantoms` (numpy, scipy) because the CLI builds every subcommand's help at
start-up, and ``fedpate privacy ...`` should not pay for the generator's imports.
"""

# Held-out regimes for measuring the phantom-to-real gap; "none" is the training distribution.
SHIFT_PARTS = ("scanner", "contrast", "lesions", "skull")
SHIFTS = ("none", *SHIFT_PARTS, "all")
SHIFT_HELP = {
    "none": "the training distribution",
    "scanner": "bias field, noise, blur and gamma beyond every training site's range",
    "contrast": "tissue intensities jittered 3x more per case and channel (orders may flip)",
    "lesions": "a smaller primary tumour plus 1-2 satellite lesions (multifocal)",
    "skull": "imperfect skull stripping: a patchy rim of dura/fat/bone left around the brain",
    "all": "every shift at once",
}
