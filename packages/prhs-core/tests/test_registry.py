"""The selector registry: registration, create(), error messages, entry-point discovery."""

from __future__ import annotations

import dataclasses
import sys
import types
import uuid
from collections.abc import Iterator
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

import prhs_core
from prhs_core import Registry, RegistryEntry, SelectorConfig, UnknownSelectorError
from prhs_core import registry as registry_module

GROUP = "test.group"


@pytest.fixture
def no_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    """Discovery finds nothing, whatever is installed in this environment."""
    monkeypatch.setattr(registry_module, "entry_points", lambda group: [])


@pytest.fixture
def reg(no_entry_points: None) -> Registry:
    return Registry("selector", entry_point_group=GROUP)


@dataclasses.dataclass(frozen=True)
class ToyConfig(SelectorConfig):
    temperature: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")


class Toy:
    def __init__(self, config: ToyConfig) -> None:
        self.config = config


def test_register_as_decorator_and_direct_call(reg: Registry) -> None:
    @reg.register("toy", config=ToyConfig, summary="a toy")
    class Decorated(Toy):
        pass

    assert Decorated.__name__ == "Decorated"  # the decorator hands back the class itself
    made = reg.register("plain", lambda **kw: ("plain", kw))
    assert callable(made)
    assert reg.names() == ["plain", "toy"]
    entry = reg.get("toy")
    assert isinstance(entry, RegistryEntry)
    assert (entry.name, entry.factory, entry.config, entry.summary) == (
        "toy",
        Decorated,
        ToyConfig,
        "a toy",
    )
    assert reg.get("plain").config is None
    assert "toy" in reg and "nope" not in reg
    assert len(reg) == 2
    assert [e.name for e in reg] == ["plain", "toy"]


def test_create_builds_the_config_from_kwargs(reg: Registry) -> None:
    reg.register("toy", Toy, config=ToyConfig)
    sel = reg.create("toy", budget=128, temperature=0.5)
    assert isinstance(sel, Toy)
    assert sel.config == ToyConfig(budget=128, temperature=0.5)
    assert reg.create("toy").config == ToyConfig()
    cfg = ToyConfig(budget=3)
    assert reg.create("toy", cfg).config is cfg
    assert reg.create("toy", config=cfg).config is cfg


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"budget": 0}, ValueError, "budget must be >= 1, got 0"),
        ({"temperature": -1.0}, ValueError, "temperature must be > 0, got -1.0"),
        ({"n_sink": True}, TypeError, "n_sink must be an int, got bool"),
    ],
    ids=["budget0", "subclass-field", "bool"],
)
def test_create_validates_through_the_config(
    reg: Registry, kwargs: dict, error: type, fragment: str
) -> None:
    built: list[object] = []
    reg.register("toy", lambda c: built.append(c), config=ToyConfig)
    with pytest.raises(error, match=fragment):
        reg.create("toy", **kwargs)
    assert built == []  # the factory never ran


def test_create_rejects_unknown_options_and_lists_the_known_ones(reg: Registry) -> None:
    reg.register("toy", Toy, config=ToyConfig)
    with pytest.raises(
        TypeError, match=r"selector 'toy' has no option\(s\) \['bugdet', 'k'\]"
    ) as e:
        reg.create("toy", bugdet=3, k=1)
    assert "options: ['block_size', 'budget', 'n_local', 'n_sink', 'temperature']" in str(e.value)


def test_create_rejects_a_config_of_the_wrong_type(reg: Registry) -> None:
    reg.register("toy", Toy, config=ToyConfig)
    with pytest.raises(TypeError, match="selector 'toy' takes a ToyConfig, got SelectorConfig"):
        reg.create("toy", SelectorConfig())
    with pytest.raises(TypeError, match="selector 'toy' takes a ToyConfig, got dict"):
        reg.create("toy", {"budget": 3})
    with pytest.raises(TypeError, match="pass either a config object or field values, not both"):
        reg.create("toy", ToyConfig(), budget=3)


def test_create_without_a_config_class_passes_kwargs(reg: Registry) -> None:
    reg.register("dense", lambda **kw: kw)
    assert reg.create("dense", scale=2) == {"scale": 2}
    with pytest.raises(TypeError, match="selector 'dense' takes no config object"):
        reg.create("dense", SelectorConfig())


def test_unknown_name_lists_every_known_name_and_suggests_a_near_miss(reg: Registry) -> None:
    for name in ("quest", "cis", "double_sparsity"):
        reg.register(name, Toy)
    with pytest.raises(UnknownSelectorError) as e:
        reg.create("qeust")
    assert isinstance(e.value, KeyError)
    msg = str(e.value)
    assert msg.startswith("unknown selector 'qeust'.")  # not quoted the KeyError way
    assert "Did you mean 'quest'?" in msg
    assert msg.endswith("Known selectors: cis, double_sparsity, quest")
    with pytest.raises(KeyError, match="Did you mean 'double_sparsity'"):
        reg.get("double_sparsty")


def test_unknown_name_without_a_near_miss_has_no_suggestion(reg: Registry) -> None:
    reg.register("cis", Toy)
    with pytest.raises(UnknownSelectorError, match="Known selectors: cis") as e:
        reg.get("zzzzzzzz")
    assert "Did you mean" not in str(e.value)
    empty = Registry("selector")
    with pytest.raises(
        UnknownSelectorError, match=r"Known selectors: none \(is prhs-selectors installed\?\)"
    ):
        empty.get("cis")


def test_duplicate_registration_raises_unless_replace(reg: Registry) -> None:
    def first(c: object) -> str:
        return "first"

    def second(c: object) -> str:
        return "second"

    reg.register("toy", first)
    with pytest.raises(
        ValueError, match=r"selector 'toy' is already registered .*pass replace=True to override"
    ):
        reg.register("toy", second)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("toy")(second)
    assert reg.get("toy").factory is first  # the failed registration changed nothing
    reg.register("toy", second, summary="v2", replace=True)
    assert reg.get("toy").factory is second and reg.get("toy").summary == "v2"
    assert reg.names() == ["toy"]


@pytest.mark.parametrize(
    "name",
    ["CIS", "1cis", "cis-x", "", "c is", "_cis", "cis\n", "cïs", 3, None],
    ids=[
        "upper",
        "digit-first",
        "dash",
        "empty",
        "space",
        "underscore-first",
        "trailing-newline",
        "non-ascii",
        "int",
        "none",
    ],
)
def test_malformed_names_are_rejected(reg: Registry, name: object) -> None:
    with pytest.raises(ValueError, match="selector names are lowercase identifiers like 'cis'"):
        reg.register(name, Toy)  # type: ignore[arg-type]
    assert reg.names() == []


def test_register_rejects_bad_config_and_factory(reg: Registry) -> None:
    with pytest.raises(TypeError, match="config must be a dataclass type"):
        reg.register("toy", Toy, config=dict)
    with pytest.raises(TypeError, match="config must be a dataclass type"):
        reg.register("toy", Toy, config=ToyConfig())  # an instance, not the type
    with pytest.raises(TypeError, match="factory for 'toy' must be callable"):
        reg.register("toy", 42)  # type: ignore[arg-type]
    assert "toy" not in reg


def test_unregister_and_defaults(reg: Registry) -> None:
    reg.register("toy", Toy, config=ToyConfig)
    reg.register("bare", Toy)
    assert reg.get("toy").defaults() == {
        "budget": 64,
        "n_sink": 4,
        "n_local": 32,
        "block_size": 1,
        "temperature": 1.0,
    }
    assert reg.get("bare").defaults() == {}
    reg.unregister("toy")
    assert reg.names() == ["bare"]
    with pytest.raises(UnknownSelectorError, match="unknown selector 'toy'"):
        reg.unregister("toy")


def test_global_registry() -> None:
    assert isinstance(prhs_core.selectors, Registry)
    assert prhs_core.selectors is registry_module.selectors
    assert prhs_core.selectors.entry_point_group == "prhs.selectors"
    assert prhs_core.selectors.kind == "selector"


# -- entry-point discovery ------------------------------------------------------------------


@pytest.fixture
def plugin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Registry, types.ModuleType, list[str]]]:
    """A registry under test, a plugin module on sys.path that registers into it, and a log of
    the groups ``entry_points`` was asked for."""
    reg = Registry("selector", entry_point_group=GROUP)
    # The plugin finds the registry under test through this handle module.
    handle = types.ModuleType("prhs_test_handle")
    handle.registry = reg  # type: ignore[attr-defined]
    handle.imports = 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "prhs_test_handle", handle)
    modname = f"prhs_test_plugin_{uuid.uuid4().hex}"
    (tmp_path / f"{modname}.py").write_text(
        "import prhs_test_handle as h\n"
        "h.imports += 1\n"
        "h.registry.register('plugged', lambda **kw: ('plugged', kw), summary='from a plugin')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    calls: list[str] = []

    def fake_entry_points(*, group: str) -> list[EntryPoint]:
        calls.append(group)
        if group != GROUP:
            return []
        return [EntryPoint(name="plugged", value=f"{modname}:unused_attr", group=GROUP)]

    monkeypatch.setattr(registry_module, "entry_points", fake_entry_points)
    yield reg, handle, calls
    sys.modules.pop(modname, None)


def test_discovery_imports_entry_points_on_first_lookup_only(plugin) -> None:
    reg, handle, calls = plugin
    assert calls == [] and handle.imports == 0  # nothing happens at construction
    assert reg.create("plugged", x=1) == ("plugged", {"x": 1})
    assert calls == [GROUP] and handle.imports == 1
    assert reg.get("plugged").summary == "from a plugin"
    with pytest.raises(UnknownSelectorError, match="Did you mean 'plugged'"):
        reg.get("pluged")
    assert reg.names() == ["plugged"]
    assert "plugged" in reg and len(reg) == 1
    assert calls == [GROUP] and handle.imports == 1  # discovery ran once


@pytest.mark.parametrize(
    "first_lookup",
    [lambda r: r.names(), lambda r: "plugged" in r, lambda r: len(r), lambda r: list(r)],
    ids=["names", "contains", "len", "iter"],
)
def test_every_kind_of_lookup_discovers(plugin, first_lookup) -> None:
    reg, handle, calls = plugin
    first_lookup(reg)
    assert calls == [GROUP] and handle.imports == 1
    assert reg.names() == ["plugged"]
    assert calls == [GROUP]


def test_discovered_names_show_in_the_unknown_name_listing(plugin) -> None:
    reg, _, calls = plugin
    reg.register("cis", Toy)
    with pytest.raises(UnknownSelectorError, match="Known selectors: cis, plugged"):
        reg.get("quest")
    assert calls == [GROUP]


def test_a_registry_without_a_group_never_discovers(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(**kwargs: object) -> list[EntryPoint]:
        raise AssertionError("entry_points must not be called")

    monkeypatch.setattr(registry_module, "entry_points", boom)
    reg = Registry("selector")
    reg.register("cis", Toy)
    assert reg.names() == ["cis"]
    with pytest.raises(UnknownSelectorError):
        reg.get("quest")
