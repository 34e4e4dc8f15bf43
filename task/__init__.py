"""The shared ML core (layer 1 of docs/ARCHITECTURE.md): data, networks, training, codecs, the world, run
settings, results and the Flower wire format that both the server and the hospitals use. It imports only
``privacy`` and itself; orchestration (runners, deployment, commands, reports) lives in ``sim``."""
