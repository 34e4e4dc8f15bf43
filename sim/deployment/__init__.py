"""Deployment tooling: Flower's command-line tools, supervised SuperLink/SuperNode processes, TLS material,
a localhost deployment of any Flower app, the recipe for separate machines, and Flower's simulation runtime.

Layer 3 (orchestration, docs/ARCHITECTURE.md): drives the installed ``flwr`` / ``flower-*`` command-line
tools as processes and never imports ``flwr`` itself.
"""
