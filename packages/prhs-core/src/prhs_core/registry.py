"""A registry from selector name to factory.

Selector packages register their factories under a lowercase name::

    from prhs_core.registry import selectors

    @selectors.register("cis", config=CISConfig, summary="Critical-index sharing (PrHS, time axis)")
    class CIS: ...

    sel = selectors.create("cis", budget=128)      # factory(CISConfig(budget=128))

Hosts only name a selector. Packages installed beside prhs-core announce their registrations in
the entry-point group ``prhs.selectors`` (the value is a module to import); the registry imports
them on the first lookup, so ``selectors.create("cis")`` works without importing prhs-selectors
first. An unknown name raises :class:`UnknownSelectorError` listing every known name.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Generic, TypeVar

__all__ = ["Registry", "RegistryEntry", "UnknownSelectorError", "selectors"]

T = TypeVar("T")
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


class UnknownSelectorError(KeyError):
    """A name that no factory is registered under. The message lists the known names."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


@dataclass(frozen=True)
class RegistryEntry(Generic[T]):
    """One registered factory.

    Attributes
    ----------
    name:
        The registered name.
    factory:
        Called with a config instance (when ``config`` is set) or with the keyword arguments.
    config:
        The frozen config dataclass the factory takes, or ``None``.
    summary:
        One line for listings (``prhs-eval selectors``).
    """

    name: str
    factory: Callable[..., T]
    config: type | None = None
    summary: str = ""

    def defaults(self) -> dict[str, Any]:
        """The config's fields and their defaults (empty without a config)."""
        if self.config is None:
            return {}
        return dataclasses.asdict(self.config())


class Registry(Generic[T]):
    """Name -> factory, with lazy discovery through an entry-point group."""

    def __init__(self, kind: str, entry_point_group: str | None = None) -> None:
        self.kind = kind
        self.entry_point_group = entry_point_group
        self._entries: dict[str, RegistryEntry[T]] = {}
        self._discovered = entry_point_group is None

    def register(
        self,
        name: str,
        factory: Callable[..., T] | None = None,
        *,
        config: type | None = None,
        summary: str = "",
        replace: bool = False,
    ) -> Any:
        """Register ``factory`` under ``name``; usable as a decorator when ``factory`` is omitted.

        Raises ``ValueError`` for a malformed name or a name already taken (unless ``replace``),
        and ``TypeError`` when ``config`` is not a dataclass.
        """
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(
                f"{self.kind} names are lowercase identifiers like 'cis' or 'double_sparsity', "
                f"got {name!r}"
            )
        if config is not None and not (
            isinstance(config, type) and dataclasses.is_dataclass(config)
        ):
            raise TypeError(f"config must be a dataclass type, got {config!r}")

        def add(f: Callable[..., T]) -> Callable[..., T]:
            if not callable(f):
                raise TypeError(f"factory for {name!r} must be callable, got {f!r}")
            if name in self._entries and not replace:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered "
                    f"(by {self._entries[name].factory!r}); pass replace=True to override"
                )
            self._entries[name] = RegistryEntry(name, f, config, summary)
            return f

        return add if factory is None else add(factory)

    def unregister(self, name: str) -> None:
        """Remove ``name`` (tests and plugins that re-register)."""
        self.get(name)
        del self._entries[name]

    def _discover(self) -> None:
        if self._discovered:
            return
        self._discovered = True
        assert self.entry_point_group is not None
        for ep in entry_points(group=self.entry_point_group):
            importlib.import_module(ep.value.split(":")[0])

    def get(self, name: str) -> RegistryEntry[T]:
        """The entry for ``name``; :class:`UnknownSelectorError` lists the known names."""
        if name not in self._entries:
            self._discover()
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            known = self.names()
            close = difflib.get_close_matches(str(name), known, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            listing = ", ".join(known) if known else "none (is prhs-selectors installed?)"
            raise UnknownSelectorError(
                f"unknown {self.kind} {name!r}.{hint} Known {self.kind}s: {listing}"
            ) from None

    def create(self, name: str, config: Any = None, **kwargs: Any) -> T:
        """Build the selector ``name`` from a config instance or from config field values.

        Field values are validated by the config dataclass before the factory runs.
        """
        entry = self.get(name)
        if entry.config is None:
            if config is not None:
                raise TypeError(f"{self.kind} {name!r} takes no config object")
            return entry.factory(**kwargs)
        if config is not None and kwargs:
            raise TypeError("pass either a config object or field values, not both")
        if config is None:
            fields = {f.name for f in dataclasses.fields(entry.config)}
            unknown = sorted(set(kwargs) - fields)
            if unknown:
                raise TypeError(
                    f"{self.kind} {name!r} has no option(s) {unknown}; options: {sorted(fields)}"
                )
            config = entry.config(**kwargs)
        elif not isinstance(config, entry.config):
            raise TypeError(
                f"{self.kind} {name!r} takes a {entry.config.__name__}, got {type(config).__name__}"
            )
        return entry.factory(config)

    def names(self) -> list[str]:
        """Every registered name, sorted (after entry-point discovery)."""
        self._discover()
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        self._discover()
        return name in self._entries

    def __iter__(self) -> Iterator[RegistryEntry[T]]:
        return iter([self._entries[n] for n in self.names()])

    def __len__(self) -> int:
        return len(self.names())


selectors: Registry[Any] = Registry("selector", entry_point_group="prhs.selectors")
"""The global selector registry every host looks names up in."""
