"""PrHS evaluation: transformers integration, offline long-context tasks, metrics, benchmarks and the prhs-eval CLI."""

__version__ = "0.1.0"
