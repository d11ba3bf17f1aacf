"""Adapters that put each benchmarked system behind the same command line (see bench/suite.py)."""
