"""PrHS selectors: CIS, PSAW, ETF and the sparse-attention baselines, one module each, registered by name."""

__version__ = "0.1.0"
