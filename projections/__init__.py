"""Projections: pure folds of the streams, and the DuckDB store they write."""
