"""Training the networks, privately or not: the U-Nets (``networks``), the one training loop (``training``), DP-SGD
(``dpsgd``) with its memoised accounting (``accounting``) and private selection of its setting (``selection``),
per-patient head gradients (``headgrad``), losses, Dice (``metrics``), test-time mirroring (``inference``), where
and how it computes (``device``, ``compute``) and where the time goes (``phases``).

Import a module, not this package: ``from task.learning.training import train_segmentation``."""
