"""The attention backends: their registry, the split view, the hook kit and one module per
served backend (named as the sglang backend module it hooks)."""
