"""Benchmarks: each script prints side-by-side figures from one run (see README's benchmark table).

Run them as scripts (`python bench/engine_vs_transformers.py ...`) or modules (`python -m bench.engine_vs_transformers`).
"""
