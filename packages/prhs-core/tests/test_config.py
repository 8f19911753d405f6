"""AttentionSpec and SelectorConfig: validation, derived properties, immutability, replace()."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prhs_core import AttentionSpec, SelectorConfig

# -- AttentionSpec --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hq", "hkv", "g"),
    [(1, 1, 1), (8, 8, 1), (8, 2, 4), (32, 4, 8), (12, 3, 4)],
    ids=["Hq1-Hkv1", "Hq8-Hkv8", "Hq8-Hkv2", "Hq32-Hkv4", "Hq12-Hkv3"],
)
def test_group_size_is_query_heads_per_kv_head(hq: int, hkv: int, g: int) -> None:
    spec = AttentionSpec(num_layers=2, num_q_heads=hq, num_kv_heads=hkv, head_dim=16)
    assert spec.group_size == g
    assert spec.group_size * spec.num_kv_heads == spec.num_q_heads


@pytest.mark.parametrize(
    ("hq", "hkv"), [(6, 4), (8, 3), (1, 2)], ids=["Hq6-Hkv4", "Hq8-Hkv3", "Hq1-Hkv2"]
)
def test_query_heads_must_be_a_multiple_of_kv_heads(hq: int, hkv: int) -> None:
    with pytest.raises(
        ValueError, match=rf"num_q_heads \({hq}\) must be a multiple of num_kv_heads \({hkv}\)"
    ):
        AttentionSpec(num_layers=1, num_q_heads=hq, num_kv_heads=hkv, head_dim=8)


@pytest.mark.parametrize("field", ["num_layers", "num_q_heads", "num_kv_heads", "head_dim"])
@pytest.mark.parametrize(
    ("value", "error", "fragment"),
    [
        (True, TypeError, "must be an int, got bool"),
        (2.0, TypeError, "must be an int, got float"),
        ("4", TypeError, "must be an int, got str"),
        (0, ValueError, "must be >= 1, got 0"),
        (-3, ValueError, "must be >= 1, got -3"),
    ],
    ids=["bool", "float", "str", "zero", "negative"],
)
def test_attention_spec_rejects_bad_ints(
    field: str, value: object, error: type, fragment: str
) -> None:
    kwargs: dict[str, object] = dict(num_layers=2, num_q_heads=4, num_kv_heads=4, head_dim=8)
    kwargs[field] = value
    with pytest.raises(error, match=f"{field} {fragment}"):
        AttentionSpec(**kwargs)  # type: ignore[arg-type]


def test_layer_types_must_have_one_entry_per_layer() -> None:
    with pytest.raises(ValueError, match=r"one entry per layer \(3\), got 2"):
        AttentionSpec(3, 4, 2, 8, layer_types=("full", "sliding"))


@pytest.mark.parametrize(
    ("types", "fragment"),
    [
        (("full", "local"), "'local'"),
        (("Full", "full"), "'Full'"),
        (("full", 3), "3"),
        (("x", 3), "'x', 3"),  # mixed types must still give a readable message
    ],
    ids=["local", "capitalised", "int", "mixed-str-int"],
)
def test_layer_types_entries_must_be_full_or_sliding(types: tuple, fragment: str) -> None:
    with pytest.raises(ValueError, match=rf"must be 'full' or 'sliding', got {fragment}"):
        AttentionSpec(2, 4, 2, 8, layer_types=types)


def test_layer_types_list_is_stored_as_a_tuple() -> None:
    spec = AttentionSpec(3, 4, 2, 8, layer_types=["full", "sliding", "full"])  # type: ignore[arg-type]
    assert spec.layer_types == ("full", "sliding", "full")
    assert isinstance(spec.layer_types, tuple)
    hash(spec)  # a frozen spec with a list inside would be unhashable


@pytest.mark.parametrize(
    ("types", "expected"),
    [
        (None, (0, 1, 2, 3, 4, 5)),
        (("full",) * 6, (0, 1, 2, 3, 4, 5)),
        (("sliding", "sliding", "full", "sliding", "sliding", "full"), (2, 5)),  # Gemma3-like
        (("full", "sliding") * 3, (0, 2, 4)),
        (("sliding",) * 6, ()),
    ],
    ids=["none", "all-full", "gemma3-5to1", "alternating", "all-sliding"],
)
def test_selectable_layers_are_the_full_layers(types: tuple | None, expected: tuple) -> None:
    spec = AttentionSpec(6, 8, 2, 16, layer_types=types)
    assert spec.selectable_layers == expected


def test_attention_spec_is_frozen() -> None:
    spec = AttentionSpec(2, 4, 2, 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.num_layers = 3  # type: ignore[misc]
    assert spec.num_layers == 2


# -- SelectorConfig -------------------------------------------------------------------------


def test_selector_config_defaults() -> None:
    cfg = SelectorConfig()
    assert (cfg.budget, cfg.n_sink, cfg.n_local, cfg.block_size) == (64, 4, 32, 1)


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"budget": 0}, ValueError, "budget must be >= 1, got 0"),
        ({"budget": -5}, ValueError, "budget must be >= 1, got -5"),
        ({"n_sink": -1}, ValueError, "n_sink must be >= 0, got -1"),
        ({"n_local": -2}, ValueError, "n_local must be >= 0, got -2"),
        ({"block_size": 0}, ValueError, "block_size must be >= 1, got 0"),
        ({"budget": True}, TypeError, "budget must be an int, got bool"),
        ({"n_sink": False}, TypeError, "n_sink must be an int, got bool"),
        ({"budget": 64.0}, TypeError, "budget must be an int, got float"),
        ({"block_size": None}, TypeError, "block_size must be an int, got NoneType"),
    ],
    ids=[
        "budget0",
        "budget-neg",
        "n_sink-neg",
        "n_local-neg",
        "block0",
        "budget-bool",
        "n_sink-bool",
        "budget-float",
        "block-none",
    ],
)
def test_selector_config_rejects_bad_values(kwargs: dict, error: type, fragment: str) -> None:
    with pytest.raises(error, match=fragment):
        SelectorConfig(**kwargs)


def test_selector_config_zero_windows_are_allowed() -> None:
    cfg = SelectorConfig(budget=1, n_sink=0, n_local=0)
    assert (cfg.budget, cfg.n_sink, cfg.n_local) == (1, 0, 0)


def test_selector_config_is_frozen() -> None:
    cfg = SelectorConfig(budget=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.budget = 16  # type: ignore[misc]
    assert cfg.budget == 8


def test_replace_returns_a_new_validated_copy() -> None:
    cfg = SelectorConfig(budget=8, n_sink=2)
    new = cfg.replace(budget=16, n_local=0)
    assert new == SelectorConfig(budget=16, n_sink=2, n_local=0)
    assert cfg == SelectorConfig(budget=8, n_sink=2)  # the original is untouched
    with pytest.raises(ValueError, match="budget must be >= 1, got 0"):
        cfg.replace(budget=0)
    with pytest.raises(TypeError, match="n_sink must be an int, got bool"):
        cfg.replace(n_sink=True)


def test_replace_rejects_unknown_fields_and_lists_known_ones() -> None:
    cfg = SelectorConfig()
    with pytest.raises(
        TypeError, match=r"SelectorConfig has no field\(s\) \['bugdet', 'window'\]"
    ) as e:
        cfg.replace(bugdet=3, window=4)
    assert "['block_size', 'budget', 'n_local', 'n_sink']" in str(e.value)


@dataclasses.dataclass(frozen=True)
class _ToyConfig(SelectorConfig):
    """A selector package's config: extra field, checked after the shared ones."""

    threshold: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.threshold < 1.0:
            raise ValueError(f"threshold must lie in (0, 1), got {self.threshold}")


def test_subclass_replace_keeps_the_subclass_and_validates_every_level() -> None:
    cfg = _ToyConfig(budget=4, threshold=0.25)
    new = cfg.replace(threshold=0.75)
    assert type(new) is _ToyConfig
    assert (new.budget, new.threshold) == (4, 0.75)
    with pytest.raises(ValueError, match=r"threshold must lie in \(0, 1\), got 2.0"):
        cfg.replace(threshold=2.0)
    with pytest.raises(ValueError, match="budget must be >= 1"):
        cfg.replace(budget=0)
    assert new.as_dict() == {
        "budget": 4,
        "n_sink": 4,
        "n_local": 32,
        "block_size": 1,
        "threshold": 0.75,
    }


def test_as_dict_is_a_detached_plain_dict() -> None:
    cfg = SelectorConfig(budget=128, n_sink=0, n_local=16, block_size=8)
    d = cfg.as_dict()
    assert d == {"budget": 128, "n_sink": 0, "n_local": 16, "block_size": 8}
    assert type(d) is dict
    d["budget"] = 1
    assert cfg.budget == 128


@settings(max_examples=40, deadline=None)
@given(
    budget=st.integers(1, 10_000),
    n_sink=st.integers(0, 64),
    n_local=st.integers(0, 512),
    block_size=st.integers(1, 128),
)
def test_as_dict_round_trips(budget: int, n_sink: int, n_local: int, block_size: int) -> None:
    cfg = SelectorConfig(budget=budget, n_sink=n_sink, n_local=n_local, block_size=block_size)
    assert SelectorConfig(**cfg.as_dict()) == cfg
    assert cfg.replace(**cfg.as_dict()) == cfg
