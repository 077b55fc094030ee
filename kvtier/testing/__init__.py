"""Helpers for tests, demos and benchmarks: tiny local models and an in-process engine."""
