"""Orchestration (layer 3 of docs/ARCHITECTURE.md): the command line, the runners, local deployment and the
reports. It drives ``server`` and ``clients``, which build on the shared core in ``task``."""
