"""Shared test helpers: fixtures, synthetic data and child processes (importable as
``helpers.<module>``)."""
