"""Benchmarks behind `hicache bench`; each prints a table and ends with one JSON line."""
