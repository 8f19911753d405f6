"""Sphinx configuration for the prhs documentation.

The workspace packages are installed editable in the uv environment (``uv sync``), so autodoc
imports them directly; no ``sys.path`` manipulation is needed.
"""

from __future__ import annotations

from importlib.metadata import version as _version

project = "prhs"
author = "prhs developers"
copyright = "prhs developers"
release = _version("prhs-core")
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

# reStructuredText only.
source_suffix = {".rst": "restructuredtext"}
root_doc = "index"
# results/<table>/table.rst are written by the table commands and included by results.rst.
exclude_patterns = ["_build", "results/*/*.rst"]

# -- autodoc ---------------------------------------------------------------------------------
autodoc_typehints = "description"
autodoc_member_order = "bysource"

# -- napoleon: NumPy-style docstrings ----------------------------------------------------------
napoleon_google_docstring = False
napoleon_numpy_docstring = True

# Warnings are errors in CI (``sphinx-build -W``); nothing is suppressed.
nitpicky = False

# -- HTML --------------------------------------------------------------------------------------
html_theme = "furo"
html_title = f"prhs {release}"

