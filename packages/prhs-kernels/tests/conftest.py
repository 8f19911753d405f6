"""Shared test helper: the same logical K/V stored in every layout an op must accept.

Tests run with ``--import-mode=importlib``, so this module cannot be imported by name; tests get
the helper through the ``make_kv`` fixture, which returns :func:`build_kv`.

:func:`build_kv` draws random *logical* keys and values for ``B`` sequences of different lengths
and stores them in:

- ``"contig"``: :class:`~prhs_core.layout.ContiguousKV` left-padded with a random ``start``;
- ``"contig0"``: :class:`~prhs_core.layout.ContiguousKV` with ``start=None`` (right padding only);
- ``"paged1"``: :class:`~prhs_core.layout.PagedKV`, ``page_size=1``, every position in a random
  pool slot;
- ``"paged16"``: :class:`~prhs_core.layout.PagedKV`, ``page_size=16``, random pages, each holding
  16 consecutive positions of one request from a page-aligned slot.

Storage that no sequence uses (padding, free pool slots, the tail of a last page) holds NaN, so a
read of it shows up as NaN in any result. Paged tables are wider than ``max_len`` (so
``max_len_hint`` is exercised), their unused entries point at NaN slots, their unused request
rows hold random slots, and ``req_pool_indices`` is a random choice of rows, not ``arange``.

Every layout has the same static ``max_len``, so an op gives results of the same shape on all of
them, and they must be identical.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from prhs_core.layout import ContiguousKV, KVLayout, PagedKV
from prhs_kernels.cis.reference import block_eligible_reference
from prhs_kernels.compose import window_widths

LAYOUTS = ("contig", "contig0", "paged1", "paged16")


@dataclass
class KVData:
    """Logical K/V and the layouts holding them.

    Attributes
    ----------
    keys, values:
        ``[B, Hkv, T, D]`` / ``[B, Hkv, T, Dv]`` logical data in the cache dtype; entries at
        ``t >= lens[b]`` are NaN (they are stored nowhere).
    lens:
        Sequence lengths as Python ints.
    seq_lens:
        ``[B]`` int32.
    max_len:
        ``T``, the static bound shared by every layout.
    layouts:
        Layout name (see :data:`LAYOUTS`) to layout.
    """

    keys: torch.Tensor
    values: torch.Tensor
    lens: list[int]
    seq_lens: torch.Tensor
    max_len: int
    layouts: dict[str, KVLayout] = field(default_factory=dict)

    def __getitem__(self, name: str) -> KVLayout:
        return self.layouts[name]


def _contiguous(
    keys: torch.Tensor,
    values: torch.Tensor,
    lens: list[int],
    t: int,
    gen: torch.Generator,
    *,
    padded: bool,
) -> ContiguousKV:
    b, h, _, d = keys.shape
    dv = values.shape[-1]
    t_cap = t  # rows shorter than T get random left padding
    k = torch.full((b, h, t_cap, d), float("nan"), dtype=keys.dtype)
    v = torch.full((b, h, t_cap, dv), float("nan"), dtype=values.dtype)
    starts = []
    for i, n in enumerate(lens):
        s = int(torch.randint(0, t_cap - n + 1, (1,), generator=gen)) if padded else 0
        starts.append(s)
        k[i, :, s : s + n] = keys[i, :, :n]
        v[i, :, s : s + n] = values[i, :, :n]
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    start = torch.tensor(starts, dtype=torch.int32) if padded else None
    return ContiguousKV(k, v, seq_lens, start)


def _paged(
    keys: torch.Tensor,
    values: torch.Tensor,
    lens: list[int],
    t: int,
    page_size: int,
    gen: torch.Generator,
) -> PagedKV:
    b, h, _, d = keys.shape
    dv = values.shape[-1]
    ps = page_size
    pages_per_row = [-(-n // ps) for n in lens]
    n_pages = sum(pages_per_row) + 3  # three free pages, never written
    n_slots = n_pages * ps
    page_perm = torch.randperm(n_pages, generator=gen)
    free_pages = page_perm[sum(pages_per_row) :]
    free_slots = (free_pages.view(-1, 1) * ps + torch.arange(ps)).flatten()
    k_pool = torch.full((n_slots, h, d), float("nan"), dtype=keys.dtype)
    v_pool = torch.full((n_slots, h, dv), float("nan"), dtype=values.dtype)
    # The table: wider than max_len (page-rounded plus 3) and with spare request rows.
    width = -(-t // ps) * ps + 3
    n_req = b + 3
    table = torch.randint(0, n_slots, (n_req, width), generator=gen, dtype=torch.int32)
    # Request slots 1 .. n_req - 1 in random order: never ``arange(B)``.
    req_pool_indices = (1 + torch.randperm(n_req - 1, generator=gen)[:b]).to(torch.int32)
    used = 0
    for i, n in enumerate(lens):
        pages = page_perm[used : used + pages_per_row[i]]
        used += pages_per_row[i]
        pos = torch.arange(n)
        slots = pages[pos // ps] * ps + pos % ps
        row = free_slots[torch.randint(0, len(free_slots), (width,), generator=gen)]
        row[:n] = slots
        table[int(req_pool_indices[i])] = row.to(torch.int32)
        k_pool[slots] = keys[i, :, :n].transpose(0, 1)
        v_pool[slots] = values[i, :, :n].transpose(0, 1)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return PagedKV(k_pool, v_pool, table, req_pool_indices, seq_lens, ps, max_len_hint=t)


def build_kv(
    lens: Sequence[int],
    num_kv_heads: int,
    head_dim: int,
    *,
    value_dim: int | None = None,
    dtype: torch.dtype = torch.float32,
    max_len: int | None = None,
    seed: int = 0,
    keys: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
) -> KVData:
    """Random logical K/V of ``B = len(lens)`` sequences, in every layout of :data:`LAYOUTS`.

    ``max_len`` (default ``max(lens)``) is the static bound ``T``. ``keys`` / ``values``
    (``[B, Hkv, T, D]``, any float dtype) replace the random data when given; ``seed`` seeds the
    logical data, and the layouts' own randomness (padding, slots) comes from ``seed + 1``.
    """
    lens = [int(n) for n in lens]
    b = len(lens)
    t = max(lens) if max_len is None else max_len
    assert t >= max(lens) >= 0
    dv = head_dim if value_dim is None else value_dim
    g = torch.Generator().manual_seed(seed)
    if keys is None:
        keys = torch.randn(b, num_kv_heads, t, head_dim, generator=g, dtype=torch.float64)
    if values is None:
        values = torch.randn(b, num_kv_heads, t, dv, generator=g, dtype=torch.float64)
    keys = keys.to(dtype).clone()
    values = values.to(dtype).clone()
    for i, n in enumerate(lens):
        keys[i, :, n:] = float("nan")
        values[i, :, n:] = float("nan")
    lay = torch.Generator().manual_seed(seed + 1)
    data = KVData(keys, values, lens, torch.tensor(lens, dtype=torch.int32), t)
    data.layouts = {
        "contig": _contiguous(keys, values, lens, t, lay, padded=True),
        "contig0": _contiguous(keys, values, lens, t, lay, padded=False),
        "paged1": _paged(keys, values, lens, t, 1, lay),
        "paged16": _paged(keys, values, lens, t, 16, lay),
    }
    for layout in data.layouts.values():
        layout.check_values()
    return data


def meta_layouts(
    b: int, hkv: int, t: int, d: int, dtype: torch.dtype = torch.float32
) -> dict[str, KVLayout]:
    """A contiguous and a paged layout whose every tensor is on ``meta`` (no value exists)."""
    m = torch.device("meta")
    i32 = torch.int32
    return {
        "contig": ContiguousKV(
            torch.empty(b, hkv, t, d, dtype=dtype, device=m),
            torch.empty(b, hkv, t, d, dtype=dtype, device=m),
            torch.empty(b, dtype=i32, device=m),
            torch.empty(b, dtype=i32, device=m),
        ),
        "contig0": ContiguousKV(
            torch.empty(b, hkv, t, d, dtype=dtype, device=m),
            torch.empty(b, hkv, t, d, dtype=dtype, device=m),
            torch.empty(b, dtype=i32, device=m),
        ),
        "paged16": PagedKV(
            torch.empty(b * t + 16, hkv, d, dtype=dtype, device=m),
            torch.empty(b * t + 16, hkv, d, dtype=dtype, device=m),
            torch.empty(b + 2, t + 16, dtype=i32, device=m),
            torch.empty(b, dtype=i32, device=m),
            torch.empty(b, dtype=i32, device=m),
            16,
            max_len_hint=t,
        ),
    }


@pytest.fixture
def make_kv():
    """:func:`build_kv`: the same logical K/V in every layout of :data:`LAYOUTS`."""
    return build_kv


def build_codes(data: KVData, name: str, *, spare: int = 5):
    """The code rows (:class:`prhs_kernels.keycodes.KeyCodes`) of layout ``name``'s keys, at
    their KV locations: contiguous rows ``b · row_stride + t`` with ``row_stride = T + spare``,
    paged the tokens' slots. Rows no position uses hold random bytes (a read of one shows)."""
    from prhs_kernels.keycodes import KeyCodes, code_bytes, write_key_codes
    from prhs_kernels.kv import token_locations

    kv = data[name]
    b, h, t, d = data.keys.shape
    row_stride = t + spare
    n_loc = b * row_stride if isinstance(kv, ContiguousKV) else kv.num_slots
    gen = torch.Generator().manual_seed(7)
    rows = torch.randint(
        0, 256, (n_loc + 1, 2, h, code_bytes(d)), generator=gen, dtype=torch.uint8
    )[:, 1]  # a strided view, as a layer's field
    pos = torch.arange(t).view(1, -1).expand(b, -1)
    loc = token_locations(kv, pos, row_stride).flatten()
    keys = data.keys.transpose(1, 2).reshape(-1, h, d)
    write_key_codes(rows, loc, torch.nan_to_num(keys), path="torch")
    return KeyCodes(rows, row_stride)


def grid_keys(keys: torch.Tensor) -> torch.Tensor:
    """``keys`` moved onto their own 4-bit grid (dequantised codes, in ``keys``' dtype): codes
    of them score them exactly, up to float rounding."""
    from prhs_kernels.keycodes import dequantize_keys_reference, quantize_keys_reference

    d = keys.shape[-1]
    return dequantize_keys_reference(quantize_keys_reference(keys), d).to(keys.dtype)


@pytest.fixture
def make_codes():
    """:func:`build_codes`: a layout's keys as code rows at their KV locations."""
    return build_codes


@pytest.fixture
def make_grid_keys():
    """:func:`grid_keys`."""
    return grid_keys


@pytest.fixture
def make_meta_layouts():
    """:func:`meta_layouts`: layouts on the ``meta`` device, for shape-only runs."""
    return meta_layouts


@pytest.fixture(params=LAYOUTS)
def layout_name(request) -> str:
    """Parametrizes a test over the layout names of :data:`LAYOUTS`."""
    return request.param


_PTR = {torch.int32: "*i32", torch.int64: "*i64", torch.float32: "*fp32",
        torch.float64: "*fp64", torch.bfloat16: "*bf16", torch.float16: "*fp16",
        torch.int8: "*i8", torch.uint8: "*u8", torch.bool: "*i1"}  # fmt: skip


def compile_for_hopper(fn, args: tuple, kw: dict) -> str:
    """Compile a caught launch of the jitted kernel ``fn`` (positional ``args``, keywords ``kw``
    with ``num_warps``, optionally ``num_stages`` and ``launch_pdl``) for sm_90 on the CPU, no
    GPU needed: Triton's compiler rejects what its interpreter runs. Returns the PTX."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    given = {**dict(zip(fn.arg_names, args, strict=False)), **kw}
    options = {"num_warps": given.pop("num_warps")}
    given.pop("num_stages", None)
    if given.pop("launch_pdl", False):
        options["launch_pdl"] = True
    const = {p.name: given[p.name] for p in fn.params if p.is_constexpr}

    def ty(v: object) -> str:
        if isinstance(v, torch.Tensor):
            return _PTR[v.dtype]
        return "fp32" if isinstance(v, float) else "i32"

    sig = {p.name: "constexpr" if p.is_constexpr else ty(given[p.name]) for p in fn.params}
    target = GPUTarget("cuda", 90, 32)
    return triton.compile(ASTSource(fn, sig, const), target=target, options=options).asm["ptx"]


@pytest.fixture
def hopper_compile():
    """:func:`compile_for_hopper`: a caught launch compiled for sm_90 on the CPU (its PTX)."""
    return compile_for_hopper


@pytest.fixture
def catch_launches(monkeypatch):
    """Every Triton launch from then on recorded as ``(kernel, args, kwargs)`` instead of run
    (``JITFunction.run`` patched): a list the test reads."""
    from triton.runtime.jit import JITFunction

    launches = []

    def run(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    monkeypatch.setattr(JITFunction, "run", run)
    return launches


# ``interpreted/`` needs Triton imported under TRITON_INTERPRET=1: ``test_triton.py`` runs it in a
# pytest process of its own, so a run without that variable leaves it out.
collect_ignore = [] if os.environ.get("TRITON_INTERPRET") == "1" else ["interpreted"]


# -- Quest's selection: page scores as Quest's scoring writes them (``-inf`` where a page may not
# be picked, random bounds elsewhere with ties, NaN and ``-inf`` sprinkled over pages that may
# be picked).
# (lens, Hkv, page size, n_sink, n_local, k): every row shape the selection meets.
SELECT_CASES = [
    ([1, 0, 40], 2, 1, 0, 0, 3),  # pages of one position, no windows, an empty row
    ([37, 5, 16, 200], 2, 16, 4, 8, 2),  # T not a multiple of the page, rows inside the windows
    ([300, 129], 4, 16, 64, 32, 64),  # k above the pages that may be picked
    ([1000, 999, 17], 1, 8, 4, 100, 16),  # a local window over many pages, unaligned
    ([5000, 4096], 8, 16, 4, 64, 64),  # Table V's Quest: 313 pages, budget 1024
    ([700], 2, 4, 0, 9, 40),  # no sink
    ([2048, 64], 2, 1, 3, 0, 100),  # no local window, 2048 pages
]
SELECT_IDS = [f"B{len(c[0])}-Hkv{c[1]}-p{c[2]}-s{c[3]}-l{c[4]}-k{c[5]}" for c in SELECT_CASES]


def quest_select_case(lens, hkv, p, n_sink, n_local, k, *, seed=0, extra_width=3):
    """``(scores, seq_lens, bad, out_indices, out_counts)``: page scores ``[B, Hkv, P]`` for rows
    of ``lens`` positions (``P`` from the longest, plus a page past it), a few ``bad`` rows, and
    output buffers ``extra_width`` entries wider than the selection needs, full of a value no
    selection holds (so that a test sees every entry written)."""
    gen = torch.Generator().manual_seed(seed)
    b = len(lens)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    n_pages = -(-max(lens) // p) + 1
    bad = torch.rand(b, hkv, generator=gen) < 0.2
    bad[0, 0] = False
    # Bounds on a coarse grid (ties), a few NaN and -inf among the pages that may be picked.
    scores = torch.randint(-40, 40, (b, hkv, n_pages), generator=gen).float() / 8
    odd = torch.rand(b, hkv, n_pages, generator=gen)
    scores[odd < 0.03] = float("nan")
    scores[(odd >= 0.03) & (odd < 0.05)] = float("-inf")
    ok = block_eligible_reference(seq_lens, n_pages, p, n_sink, n_local)
    ok = ok.unsqueeze(1) & ~bad.unsqueeze(-1)
    scores = scores.masked_fill(~ok, float("-inf"))
    ws, wl = window_widths(n_sink, n_local, p)
    width = ws + k + wl + extra_width
    out = torch.full((b, hkv, width), 12345, dtype=torch.int32)
    cnt = torch.full((b, hkv), 12345, dtype=torch.int32)
    return scores, seq_lens, bad, out, cnt


@pytest.fixture(params=SELECT_CASES, ids=SELECT_IDS)
def quest_case(request) -> tuple:
    """Parametrizes a test over :data:`SELECT_CASES`: ``(case, built)`` with ``built`` from
    :func:`quest_select_case`."""
    return request.param, quest_select_case(*request.param, seed=len(request.param[0]))


@pytest.fixture
def make_quest_case():
    """:func:`quest_select_case`: page scores, lengths, bad rows and output buffers."""
    return quest_select_case


# ---------------------------------------------------------------------------------------------
# The interpreted suite (``interpreted/``, run by ``test_triton.py`` in a process of its own with
# ``TRITON_INTERPRET=1``) is the longest part of the tests and runs on one core. It starts as soon
# as collection finishes and its test runs last, so a two-core CI machine runs it beside every
# other test; ``test_triton.py`` then waits for its result. Started only when that test is
# selected, never by ``--collect-only``, and stopped at the end of a session that did not wait.
# ---------------------------------------------------------------------------------------------

INTERPRETED_TEST = "test_triton.py::test_triton_kernels_under_the_interpreter"
INTERPRETED_DIR = Path(__file__).resolve().parent / "interpreted"


@dataclass
class InterpretedRun:
    """The interpreted suite's pytest process and the file its output goes to."""

    process: subprocess.Popen
    log: object  # the temporary file, opened for writing and reading

    def result(self) -> tuple[int, str]:
        """Waits for the run; its exit status and output."""
        returncode = self.process.wait()
        self.log.seek(0)
        return returncode, self.log.read()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.log.close()


INTERPRETED_RUN = pytest.StashKey[InterpretedRun]()


def start_interpreted_run() -> InterpretedRun:
    """Starts ``pytest interpreted/`` with ``TRITON_INTERPRET=1`` (Triton reads the variable at
    import, and this process may already have imported it without), its output to a file (a
    pipe left unread would block it)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("PRHS_KERNELS", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(INTERPRETED_DIR)]
    log = tempfile.TemporaryFile("w+", encoding="utf-8")
    process = subprocess.Popen(
        cmd,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=INTERPRETED_DIR.parents[3],
    )
    return InterpretedRun(process, log)


def pytest_collection_modifyitems(session, config, items):
    """The interpreted suite's test last, so that every other test runs while it does."""
    last = [item for item in items if item.nodeid.endswith(INTERPRETED_TEST)]
    if last:
        items[:] = [item for item in items if item not in last] + last


def pytest_collection_finish(session):
    if session.config.option.collectonly or os.environ.get("TRITON_INTERPRET") == "1":
        return
    if importlib.util.find_spec("triton") is None:
        return
    if any(item.nodeid.endswith(INTERPRETED_TEST) for item in session.items):
        session.config.stash[INTERPRETED_RUN] = start_interpreted_run()


def pytest_sessionfinish(session):
    run = session.config.stash.get(INTERPRETED_RUN, None)
    if run is not None:
        run.stop()
        del session.config.stash[INTERPRETED_RUN]


@pytest.fixture
def interpreted_result(request) -> tuple[int, str]:
    """The interpreted suite's exit status and output: the run started at collection, or one
    started now where none was (the test called some other way)."""
    run = request.config.stash.get(INTERPRETED_RUN, None)
    if run is None:
        run = start_interpreted_run()
        request.addfinalizer(run.stop)
    return run.result()
