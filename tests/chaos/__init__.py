"""Chaos tests, CI-sized: faults injected into a tiny-model cluster under a steady
streaming load; ``bench/chaos/`` runs the same faults longer, on the bundled model."""
