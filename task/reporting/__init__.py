"""What a run leaves behind and how it is read: ``results.json`` (``results``), the model bundle and its card
(``bundle``, ``model_card``), each method's trust model (``trust``), the code's commit (``provenance``), the
real-scan check (``realcheck``) and prediction with a released model (``predict``).

Import a module, not this package: ``from task.reporting.results import write_run``."""
