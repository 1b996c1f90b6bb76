"""Test support code that builds real artefacts (checkpoints) for the suite."""
