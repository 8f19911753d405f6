"""PrHS SGLang plugin: prhs selectors as an attention backend inside the SGLang server."""

__version__ = "0.1.0"
