"""prhs_core.checks: every check accepts what it should and names the problem when it raises."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from prhs_core import checks
from prhs_core.checks import (
    check_bool_mask,
    check_counter,
    check_device,
    check_flag,
    check_float_tensor,
    check_in_range,
    check_index_tensor,
    check_int,
    check_probability,
    check_same_shape,
    check_shape,
    check_values_finite,
    shape_str,
)


def test_every_public_check_is_exported() -> None:
    assert sorted(checks.__all__) == sorted(
        n for n in dir(checks) if n.startswith(("check_", "shape_str"))
    )


# -- check_int ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "minimum"), [(0, None), (-5, None), (3, 3), (10**12, 1)], ids=str
)
def test_check_int_returns_valid_ints(value: int, minimum: int | None) -> None:
    assert check_int("n", value, minimum=minimum) == value


@pytest.mark.parametrize(
    ("value", "minimum", "error", "fragment"),
    [
        (True, None, TypeError, "n must be an int, got bool True"),
        (2.0, None, TypeError, "n must be an int, got float 2.0"),
        ("3", None, TypeError, "n must be an int, got str '3'"),
        (torch.tensor(3), None, TypeError, "n must be an int, got Tensor"),
        (2, 3, ValueError, "n must be >= 3, got 2"),
        (-1, 0, ValueError, "n must be >= 0, got -1"),
    ],
    ids=["bool", "float", "str", "tensor", "below-min", "negative"],
)
def test_check_int_rejects(value: object, minimum: int | None, error: type, fragment: str) -> None:
    with pytest.raises(error, match=fragment):
        check_int("n", value, minimum=minimum)


# -- check_probability ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [0, 1, 0.0, 0.5, 1.0, torch.tensor([0.0, 0.25, 1.0]), torch.empty(0)],
    ids=["int0", "int1", "zero", "half", "one", "tensor", "empty-tensor"],
)
def test_check_probability_accepts_the_unit_interval(value: object) -> None:
    check_probability("p", value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "error", "fragment"),
    [
        (-0.1, ValueError, r"p must lie in \[0, 1\], got -0.1"),
        (1.5, ValueError, r"p must lie in \[0, 1\], got 1.5"),
        (math.nan, ValueError, r"p must lie in \[0, 1\], got nan"),
        (True, TypeError, "p must be a float in"),
        ("0.5", TypeError, "p must be a float in .* got str"),
        (torch.tensor([0.5, 2.0, -1.0]), ValueError, r"p must lie in \[0, 1\], got a value of 2.0"),
        (torch.tensor([0.5, math.nan]), ValueError, "got a value of nan"),
    ],
    ids=["neg", "above", "nan", "bool", "str", "tensor-above", "tensor-nan"],
)
def test_check_probability_rejects(value: object, error: type, fragment: str) -> None:
    with pytest.raises(error, match=fragment):
        check_probability("p", value)  # type: ignore[arg-type]


# -- shape_str ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arg", "expected"),
    [
        (torch.zeros(2, 3, 4), "[2, 3, 4]"),
        (torch.tensor(1.0), "[]"),
        (torch.zeros(0, 5), "[0, 5]"),
        ((7,), "[7]"),
        ([], "[]"),
    ],
    ids=["3d", "scalar", "empty-dim", "tuple", "empty-list"],
)
def test_shape_str(arg: object, expected: str) -> None:
    assert shape_str(arg) == expected  # type: ignore[arg-type]


# -- tensor kind checks ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("t", "kwargs", "error", "fragment"),
    [
        ([1.0], {}, TypeError, "x must be a torch.Tensor, got list"),
        (torch.zeros(2, dtype=torch.int32), {}, TypeError, "x must be a floating-point tensor"),
        (
            torch.zeros(2, 3),
            {"ndim": 3},
            ValueError,
            r"x must have 3 dimensions, got shape \[2, 3\]",
        ),
        (torch.zeros(2), {"min_ndim": 2}, ValueError, r"at least 2 dimensions, got shape \[2\]"),
    ],
    ids=["list", "int", "ndim", "min-ndim"],
)
def test_check_float_tensor_rejects(t: object, kwargs: dict, error: type, fragment: str) -> None:
    with pytest.raises(error, match=fragment):
        check_float_tensor("x", t, **kwargs)


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str
)
def test_check_float_tensor_accepts_float_dtypes(dtype: torch.dtype) -> None:
    check_float_tensor("x", torch.zeros(1, 2, 3, dtype=dtype), ndim=3, min_ndim=2)


@pytest.mark.parametrize(
    ("t", "error", "fragment"),
    [
        ([True], TypeError, "m must be a torch.Tensor, got list"),
        (torch.zeros(2, 3, dtype=torch.uint8), TypeError, "m must be a torch.bool mask, got dtype"),
        (
            torch.zeros(3, 2, dtype=torch.bool),
            ValueError,
            r"m must have shape \[2, 3\], got \[3, 2\]",
        ),
    ],
    ids=["list", "uint8", "transposed"],
)
def test_check_bool_mask_rejects(t: object, error: type, fragment: str) -> None:
    with pytest.raises(error, match=fragment):
        check_bool_mask("m", t, (2, 3))


def test_check_flag() -> None:
    check_flag("f", torch.zeros(1, dtype=torch.bool))
    check_flag("f", torch.ones((), dtype=torch.bool), torch.device("cpu"))
    for bad, fragment in [
        (torch.zeros(1, dtype=torch.int32), "int32 of shape"),
        (torch.zeros(2, dtype=torch.bool), r"shape \[2\]"),
        (None, "NoneType"),
    ]:
        with pytest.raises(ValueError, match=f"f must be a one-element bool tensor.*{fragment}"):
            check_flag("f", bad)
    meta = torch.zeros(1, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match=r"on cpu \(hint\), got torch.bool .* on meta"):
        check_flag("f", meta, torch.device("cpu"), " (hint)")


def test_check_counter() -> None:
    check_counter("n", torch.zeros(1, dtype=torch.int64))
    check_counter("n", torch.zeros((), dtype=torch.int64), torch.device("cpu"))
    for bad, fragment in [
        (torch.zeros(1, dtype=torch.int32), "int32 of shape"),
        (torch.zeros(1, dtype=torch.bool), "bool of shape"),
        (torch.zeros(1, 2, dtype=torch.int64), r"shape \[1, 2\]"),
        (3, "int"),
    ]:
        with pytest.raises(ValueError, match=f"n must be a one-element int64 tensor.*{fragment}"):
            check_counter("n", bad)
    meta = torch.zeros(1, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match=r"on cpu \(hint\), got torch.int64 .* on meta"):
        check_counter("n", meta, torch.device("cpu"), " (hint)")


@pytest.mark.parametrize(
    "dtype", [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64], ids=str
)
def test_check_index_tensor_accepts_integer_dtypes(dtype: torch.dtype) -> None:
    check_index_tensor("i", torch.zeros(2, 2, dtype=dtype), ndim=2)


@pytest.mark.parametrize(
    ("t", "error", "fragment"),
    [
        ((1, 2), TypeError, "i must be a torch.Tensor, got tuple"),
        (torch.zeros(2), TypeError, "i must be an integer tensor, got dtype torch.float32"),
        (torch.zeros(2, dtype=torch.bool), TypeError, "got dtype torch.bool"),
        (torch.zeros(2, dtype=torch.complex64), TypeError, "got dtype torch.complex64"),
        (torch.zeros(2, 2, dtype=torch.long), ValueError, r"i must have 1 dimensions, got shape"),
    ],
    ids=["tuple", "float", "bool", "complex", "ndim"],
)
def test_check_index_tensor_rejects(t: object, error: type, fragment: str) -> None:
    with pytest.raises(error, match=fragment):
        check_index_tensor("i", t, ndim=1)


# -- shapes and devices ---------------------------------------------------------------------


def test_check_same_shape() -> None:
    a, b = torch.zeros(2, 3), torch.zeros(2, 3)
    check_same_shape(["a", "b"], [a, b])
    with pytest.raises(ValueError, match=r"c must have the same shape as a \[2, 3\], got \[3, 2\]"):
        check_same_shape(["a", "b", "c"], [a, b, torch.zeros(3, 2)])


@pytest.mark.parametrize(
    ("shape", "expected"),
    [((2, 5), (2, None)), ((2, 5), (2, 5)), ((0,), (None,)), ((), ())],
    ids=["wildcard", "exact", "empty", "scalar"],
)
def test_check_shape_accepts(shape: tuple, expected: tuple) -> None:
    check_shape("x", torch.zeros(shape), expected, "[...]")


@pytest.mark.parametrize(
    ("shape", "fragment"),
    [
        ((3, 5), r"x must have shape \[B, K\] = \[2, \*\], got \[3, 5\]"),
        ((2,), r"x must have shape \[B, K\] = \[2, \*\], got \[2\]"),
        ((2, 5, 1), r"got \[2, 5, 1\]"),
    ],
    ids=["size", "too-few-dims", "too-many-dims"],
)
def test_check_shape_rejects(shape: tuple, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        check_shape("x", torch.zeros(shape), (2, None), "[B, K]")


def _on(device: str) -> torch.Tensor:
    # check_device reads only ``.device``: a stand-in covers devices this machine lacks.
    return SimpleNamespace(device=torch.device(device))  # type: ignore[return-value]


@pytest.mark.parametrize(
    "devices",
    [("cpu", "cpu"), ("cpu", "meta"), ("meta", "cuda:0"), ("cuda:1", "meta", "cuda:1")],
    ids=["cpu-cpu", "cpu-meta", "meta-cuda", "cuda-meta-cuda"],
)
def test_check_device_accepts_one_device_and_meta(devices: tuple[str, ...]) -> None:
    names = [f"t{i}" for i in range(len(devices))]
    check_device(names, [_on(d) for d in devices])


@pytest.mark.parametrize(
    ("devices", "fragment"),
    [
        (("cpu", "cuda:0"), "t1 is on cuda:0 but t0 is on cpu; move them to one device"),
        (("cuda:0", "cuda:0", "cuda:1"), "t2 is on cuda:1 but t0 is on cuda:0"),
    ],
    ids=["cpu-cuda", "cuda0-cuda1"],
)
def test_check_device_rejects_two_devices(devices: tuple[str, ...], fragment: str) -> None:
    names = [f"t{i}" for i in range(len(devices))]
    with pytest.raises(ValueError, match=fragment):
        check_device(names, [_on(d) for d in devices])


# -- value checks ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "t",
    [
        torch.randn(3, 4),
        torch.empty(0, 4),
        torch.arange(5),
        torch.full((2, 2), math.nan, device="meta"),
    ],
    ids=["finite", "empty", "int", "meta"],
)
def test_check_values_finite_accepts(t: torch.Tensor) -> None:
    check_values_finite("q", t)


@pytest.mark.parametrize(
    ("bad", "where", "fragment"),
    [
        (math.nan, "", r"q holds a non-finite value \(nan\) at index \[1, 2\];"),
        (math.inf, " (layer 3)", r"value \(inf\) at index \[1, 2\] \(layer 3\); prhs never"),
        (-math.inf, "", r"\(-inf\) at index \[1, 2\]"),
    ],
    ids=["nan", "inf-where", "neg-inf"],
)
def test_check_values_finite_names_the_first_bad_index(
    bad: float, where: str, fragment: str
) -> None:
    t = torch.zeros(3, 4)
    t[1, 2] = bad
    t[2, 0] = bad  # a later one: the message gives the first
    before = t.clone()
    with pytest.raises(ValueError, match=fragment):
        check_values_finite("q", t, where=where)
    assert repr(t.tolist()) == repr(before.tolist())  # read only (nan == nan as text)


@pytest.mark.parametrize(
    ("t", "low", "high"),
    [
        (torch.tensor([0, 5, 3]), 0, 5),
        (torch.tensor([[1, 2], [3, 4]]), torch.tensor(1), torch.tensor(4)),
        (torch.tensor([2, 7]), torch.tensor([2, 0]), torch.tensor([2, 7])),
        (torch.empty(0, dtype=torch.long), 1, 0),
        (torch.full((3,), -9, device="meta"), 0, 1),
    ],
    ids=["ints-inclusive", "scalar-tensors", "per-element", "empty", "meta"],
)
def test_check_in_range_accepts(t: torch.Tensor, low: object, high: object) -> None:
    check_in_range("x", t, low, high, "bounds")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("t", "low", "high", "fragment"),
    [
        (torch.tensor([0, 6, 9]), 0, 5, r"x\[1\] = 6 is out of range: the cache \(\[0, 5\]\)"),
        (
            torch.tensor([[1, 1], [0, 1]]),
            1,
            3,
            r"x\[1, 0\] = 0 is out of range: the cache \(\[1, 3\]\)",
        ),
        (
            torch.tensor([3, 4, 5], dtype=torch.int32),
            torch.tensor([0, 0, 0]),
            torch.tensor([9, 3, 9]),
            r"x\[1\] = 4 is out of range: the cache \(\[0, 3\]\)",  # that element's bound
        ),
        (
            torch.tensor([5]),
            torch.tensor(6),
            9,
            r"x\[0\] = 5 is out of range: the cache \(\[6, 9\]\)",
        ),
    ],
    ids=["above", "below-2d", "per-element-bound", "scalar-tensor-low"],
)
def test_check_in_range_names_index_value_and_bounds(
    t: torch.Tensor, low: object, high: object, fragment: str
) -> None:
    with pytest.raises(ValueError, match=fragment):
        check_in_range("x", t, low, high, "the cache")  # type: ignore[arg-type]
