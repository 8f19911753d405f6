"""PrHS evaluation: transformers integration, tasks, metrics and the prhs-eval CLI."""

__version__ = "0.1.0"
