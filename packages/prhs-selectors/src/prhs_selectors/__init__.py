"""PrHS selectors: CIS, PSAW, ETF and the baselines, one module each, by name."""

__version__ = "0.1.0"
