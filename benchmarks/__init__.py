"""The benchmarks behind the documented figures (README.md here): run from a checkout, never installed."""
