"""Helpers of tests/bench/bench_passthrough.py: stand-in vLLM, load generator, proxies."""
