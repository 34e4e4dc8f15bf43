"""fedpate deployment smoke-check app: each SuperNode echoes its node_config (sim/deployment/echo_app)."""
