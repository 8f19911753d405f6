"""``cis``: Critical-Index Sharing, PrHS's selector on the time axis.

Consecutive decoding queries of a head are similar, and so are their critical indices. CIS keeps,
per (sequence, layer, KV head), an *anchor*: the query that last scored every key, its critical
set ``S_a`` and when it was made. A new query close enough to the anchor reuses ``S_a`` (dilated
around its strongest entries) instead of scoring the cache again; otherwise it retrieves and
becomes the new anchor. ``S_a`` was chosen outside the anchor's local window, so a reuse reads the
local window from where the anchor's started (``hold_local``; in the paper's reading the window
slides, and the positions leaving it are read by nobody until the next retrieval).

In paper mode a reuse can also re-rank what it reads (``rescore``): a retrieval keeps, beside
its top ``k``, the next ``rescore`` positions of the same ranking, and each reuse scores this pool
at its own query, from the pool's keys and the windows' alone, and reads the best ``k`` of it.

Two reuse rules:

- paper mode (``delta_max=None``): reuse iff ``cos(q, q_a) ≥ τ`` and ``t − t_a ≤ n_local``;
- certified mode (``delta_max`` set): reuse iff a pre-hoc certificate ``δ̂_h ≤ δ_max`` holds
  for every query head ``h`` of the group, and also the paper rule unless
  ``require_cosine=False``. The certificate is per page (``certificate="page"``, the default):
  ``δ̂_h = A_h / (A_h + C_h)`` with ``A_h = Σ_P m^drop_{P,h} e^{u_{P,h}}``,
  ``C_h = Σ_P m^sel_{P,h} e^{l_{P,h}}``, the anchor's per-page masses and the bounds of the
  logit change ``(q_h − q_{a,h})·k·scaling`` over each page's key box; or global
  (``certificate="global"``): ``δ̂_h = δ_{a,h} e^{2ε_h} / (δ_{a,h} e^{2ε_h} + 1 − δ_{a,h})`` with
  ``ε_h = ‖q_h − q_{a,h}‖ · K_max · scaling``. A retrieval picks the smallest top set whose
  dropped mass is at most ``delta_target`` for every query head, capped at ``k_max`` positions.

Reading of the certificate's anchor set (ours): ``A = sink ∪ S_a ∪ dilate(S_a)``, with the
anchor's local window too under ``hold_local`` (a reuse then reads the local window from where
the anchor's started). Every later reuse reads ``A``, plus the local window, which holds every
position added since the anchor (``t − t_a ≤ n_local``). So ``δ_h(S_t; q) ≤ δ̂_h`` holds for
the set actually read, for each query head.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from prhs_core.checks import (
    check_float_tensor,
    check_int,
    check_probability,
    check_values_finite,
)
from prhs_core.config import AttentionSpec, SelectorConfig
from prhs_core.layout import ContiguousKV, KVLayout
from prhs_core.plan import DecodePlan
from prhs_core.registry import selectors
from prhs_core.selection import Selection
from prhs_core.state import SelectorState
from prhs_core.theory import (
    log_page_reuse_certificate,
    log_reuse_certificate,
    logit_shift_bound,
    page_box_shift_bounds,
    page_log_masses,
    round_to_float32,
)
from prhs_kernels.blocks import block_reduce
from prhs_kernels.cis import (
    anchor_union_reference,
    check_block_score,
    cis_compose,
    cis_decide,
    cis_decide_compose,
    cis_local_width,
    cis_path,
    cis_rescore,
    held_local_indices,
    retrieval_block_scores,
    retrieval_compose,
    retrieval_pool,
    top_blocks,
)
from prhs_kernels.compose import dilate_indices, union_indices
from prhs_kernels.graphs import forked, join, run_if
from prhs_kernels.keycodes import KeyCodes, code_bytes, key_center, write_key_codes
from prhs_kernels.kv import gather_kv, token_locations
from prhs_kernels.score import max_key_norm, score_keys
from prhs_kernels.topk import topk_indices
from prhs_selectors.base import BaseSelector, fold_page_bounds
from prhs_selectors.cis_calibration import TAU_GRID, ReplayConfig, choose_tau, replay_curves

__all__ = [
    "AUTO_TAU",
    "CERTIFICATES",
    "CIS",
    "FALLBACK_TAU",
    "MIN_CENTER_KEYS",
    "SCORERS",
    "CISConfig",
]

NEG_INF = float("-inf")

#: ``tau="auto"``: calibrate a threshold per (layer, KV head) on each prompt.
AUTO_TAU = "auto"
#: The threshold of a row ``tau="auto"`` could not calibrate (a prompt too short, a host that
#: shows no prompt).
FALLBACK_TAU = 0.72
#: Certified mode's certificates, and the page of the per-page one (positions).
CERTIFICATES = ("page", "global")
EXPANSIONS = ("dilate", "random")
#: What a paper-mode retrieval and re-ranking score: 4-bit key codes, or the keys.
SCORERS = ("int4", "exact")

#: Keys a write must hold (rows, as the host gives them) to fix an unpinned centre of the key
#: codes: a short write (SGLang's six-token warm-up request) gives a poor mean, and on Qwen2.5-0.5B
#: (KJV, 4k) codes around it lost a fifth more mass than around a prompt's (beta 0.0209 against
#: 0.0175; around 0, 0.0314). Codes written before are taken around 0.
MIN_CENTER_KEYS = 64
DEFAULT_CERTIFICATE_PAGE = 16
#: ``tau="auto"``'s defaults: the mean retrieval ratio aimed at, and the prompt queries replayed.
#: The ratio is lower when reuses re-rank their anchor's pool (``rescore``): they then lose a
#: quarter to a third of what a plain reuse loses, so fewer retrievals keep as much mass.
DEFAULT_TARGET_RHO = 0.28
DEFAULT_TARGET_RHO_RESCORE = 0.2
DEFAULT_PROMPT_QUERIES = 32
#: ``rescore=None`` in paper mode: the pool a retrieval keeps beyond its ``k``, in multiples of
#: ``k``.
DEFAULT_RESCORE_FACTOR = 2

_ANCHOR_FIELDS = (
    "anchor_q",
    "anchor_len",
    "anchor_idx",
    "anchor_cnt",
    "anchor_log_delta",
)


def _check_tau(tau: object) -> float | str | tuple[tuple[float, ...], ...]:
    """``tau`` as ``"auto"``, a float, or a table of floats (rows: layers; columns: one, or one
    per KV head), every value a cosine threshold in [-1, 1.01] (above 1: that row always
    retrieves)."""

    def one(x: object, where: str) -> float:
        if isinstance(x, bool) or not isinstance(x, int | float):
            raise TypeError(f"tau{where} must be a float, got {type(x).__name__}")
        if not -1.0 <= x <= 1.01 or (where == "" and x > 1.0):
            bound = "[-1, 1]" if where == "" else "[-1, 1.01]"
            raise ValueError(f"tau{where} is a cosine threshold and must lie in {bound}, got {x}")
        return float(x)

    if isinstance(tau, str):
        if tau != AUTO_TAU:
            raise ValueError(f"tau must be a float, a table or {AUTO_TAU!r}, got {tau!r}")
        return tau
    if not isinstance(tau, list | tuple):
        return one(tau, "")
    if not tau or not all(isinstance(row, list | tuple) and row for row in tau):
        raise ValueError(
            "a tau table must be a non-empty list of non-empty rows, one per layer "
            "(each one threshold, or one per KV head)"
        )
    return tuple(
        tuple(one(x, f"[{i}][{j}]") for j, x in enumerate(row)) for i, row in enumerate(tau)
    )


@dataclass(frozen=True)
class CISConfig(SelectorConfig):
    """Hyperparameters of CIS (the paper's, except ``block_size``, ``block_score`` and ``tau``,
    which measured better on real text; see the CIS docs page).

    Parameters
    ----------
    budget:
        ``k``, positions chosen at a retrieval (``k/s`` blocks), sink and local not counted.
    n_sink, n_local:
        Always-selected windows; ``n_local`` also bounds how long an anchor lives.
    block_size:
        ``s``: selection and reading in aligned blocks (CIS-8, CIS-16); 1 (the default) is per
        token.
    block_score:
        How a retrieval ranks blocks (``s > 1``): ``"mass"`` (default), the sum of its
        positions' group-mean probabilities, the attention mass it holds (what the dropped mass
        counts), or ``"max"``, its largest one (the paper's reading).
    tau:
        Cosine threshold ``τ`` between the group's concatenated queries and the anchor's.
        ``"auto"`` (the default): calibrated on each prompt, one per (layer, KV head), for a
        mean retrieval ratio of ``target_rho`` (see :meth:`CIS.observe_prompt`); rows it could
        not calibrate use 0.72. In certified mode the calibrated threshold is the cosine gate
        that comes on top of the certificate (``require_cosine``). A float: one threshold for
        every row (the paper's 0.8 retrieves at about half the steps on the models measured).
        A table: one row per layer, each row one threshold for every KV head or one per KV
        head (what
        ``benchmarks/scripts/cis_rules.py calibrate`` writes for a model).
    target_rho:
        ``tau="auto"`` only: the mean retrieval ratio the calibration aims at (default 0.2 when
        reuses re-rank, ``rescore > 0``, else 0.28).
    prompt_queries:
        ``tau="auto"`` only: how many of the prompt's last queries the calibration replays
        (default 32, at least 2).
    hold_local:
        A reuse also reads the positions that left the local window since its anchor was made
        (the window starts where the anchor's did): the anchor's list was chosen outside its
        window, so without this they would be read by nobody. ``False`` is the paper's reading.
    rescore:
        Paper mode: a retrieval also keeps the next ``rescore`` positions (blocks: rounded up)
        of its ranking, and every reuse scores this pool of ``k + rescore`` at its own query,
        from the keys of the pool and the windows only (each query head normalised over what
        it reads), and reads the best ``k``: the set follows the query between retrievals for
        ``rescore`` more key rows read per reuse. ``None`` (the default): ``2·k`` in paper mode,
        0 in certified mode; 0: the anchor's list as it was (the paper's reuse).
    n_den:
        Dilation density: the top ``m = ⌊k/n_den⌋`` positions (blocks) of ``S_a`` are dilated.
    r:
        Dilation radius: each dilated ``p`` adds ``p ± j`` for ``1 ≤ j ≤ r``.
    expansion:
        What a reuse adds to the anchor's list: ``"dilate"`` (the default), the ``2·r·m``
        neighbours above; ``"random"``, as many positions (blocks) drawn uniformly from the
        context instead, a fresh draw per step, layer and head (the paper's RandomExpansion
        control: same width, no locality). Paper mode only.
    delta_max:
        Certified mode when set: reuse only if every query head's ``δ̂ ≤ delta_max``.
    certificate:
        Certified mode's bound: ``"page"`` (the default), per page of ``certificate_page``
        positions from each page's key minima and maxima and the anchor's per-page masses, or
        ``"global"``, one ``ε`` from the largest key norm.
    certificate_page:
        Positions per page of the per-page certificate (default 16). A paged KV pool must use
        pages of a multiple of it.
    require_cosine:
        In certified mode, also require the paper rule (``True``: "additionally") or use the
        certificate alone (``False``: "instead").
    delta_target:
        Certified retrieval: the top-p set's dropped-mass target (default ``delta_max / 2``).
    k_max:
        Certified retrieval: cap on the top-p set, in positions (default ``4·k``).
    scorer:
        Paper mode: what a retrieval and a re-ranking (``rescore``) score, ``"int4"`` (a side
        cache of 4-bit keys written at every K/V write, :mod:`prhs_kernels.keycodes`:
        ``D/2 + 8`` bytes a key rounded up to 16, 31 % of a bf16 key at ``D = 128``) or
        ``"exact"`` (the keys). The attention always reads the exact keys and values of what
        is selected. ``None`` (the default) is ``"int4"`` in paper mode and ``"exact"`` in
        certified mode, which refuses ``"int4"`` (its certificate needs exact logits). Against
        ``"exact"``, ``"int4"`` reads half the bytes a step at 4k tokens with the same quality
        (see the CIS docs page), its Triton step is 8-13 % faster at B16 on an H100 (5 %
        slower at B1), and its side cache takes 16 % of a bf16 KV pool's memory. The codes are
        taken around a centre per layer and KV head: the mean of the first write of at least
        :data:`MIN_CENTER_KEYS` keys to the layer, or one pinned before any write
        (:meth:`CIS.set_key_center`, e.g. from a calibration prompt), which makes every
        request's codes independent of the requests written before or beside it.
    """

    budget: int = 64
    n_sink: int = 4
    n_local: int = 32
    block_size: int = 1
    block_score: str = "mass"
    tau: float | str | tuple[tuple[float, ...], ...] = AUTO_TAU
    target_rho: float | None = None
    prompt_queries: int | None = None
    hold_local: bool = True
    rescore: int | None = None
    n_den: int = 3
    r: int = 1
    expansion: str = "dilate"
    delta_max: float | None = None
    certificate: str | None = None
    certificate_page: int | None = None
    require_cosine: bool = True
    delta_target: float | None = None
    k_max: int | None = None
    scorer: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "tau", _check_tau(self.tau))
        check_block_score(self.block_score)
        if not isinstance(self.hold_local, bool):
            raise TypeError(f"hold_local must be a bool, got {type(self.hold_local).__name__}")
        check_int("n_den", self.n_den, minimum=1)
        check_int("r", self.r, minimum=0)
        if self.expansion not in EXPANSIONS:
            raise ValueError(f"expansion must be one of {EXPANSIONS}, got {self.expansion!r}")
        if self.rescore is not None:
            check_int("rescore", self.rescore, minimum=0)
        if not isinstance(self.require_cosine, bool):
            raise TypeError("require_cosine must be a bool")
        if self.scorer is not None and self.scorer not in SCORERS:
            raise ValueError(f"scorer must be one of {SCORERS} (or None), got {self.scorer!r}")
        self._check_auto()
        if self.delta_max is None:
            if not self.require_cosine:
                raise ValueError(
                    "require_cosine=False needs delta_max: there would be no reuse rule"
                )
            if (
                self.delta_target is not None
                or self.k_max is not None
                or self.certificate is not None
                or self.certificate_page is not None
            ):
                raise ValueError(
                    "delta_target, k_max, certificate and certificate_page apply to certified "
                    "mode: set delta_max"
                )
            return
        if self.expansion != "dilate":
            raise ValueError(
                f"expansion={self.expansion!r} applies to paper mode: a certified reuse reads "
                "sink ∪ S_a ∪ dilate(S_a) ∪ local, the set its certificate bounds (set "
                "delta_max=None, or expansion='dilate')"
            )
        if self.rescore:
            raise ValueError(
                "rescore applies to paper mode: a certified reuse reads the anchor's set, the one "
                "its certificate bounds (set delta_max=None, or rescore=0)"
            )
        if self.scorer == "int4":
            raise ValueError(
                "scorer='int4' applies to paper mode: a certified retrieval's dropped mass is "
                "computed from exact logits (set delta_max=None, or scorer='exact')"
            )
        if self.certificate is not None and self.certificate not in CERTIFICATES:
            raise ValueError(f"certificate must be one of {CERTIFICATES}, got {self.certificate!r}")
        if self.certificate_page is not None:
            check_int("certificate_page", self.certificate_page, minimum=1)
            if self.certificate == "global":
                raise ValueError("certificate_page applies to certificate='page'")
        check_probability("delta_max", self.delta_max)
        if not 0.0 < self.delta_max < 1.0:
            raise ValueError(f"delta_max must lie in (0, 1), got {self.delta_max}")
        if self.delta_target is not None:
            check_probability("delta_target", self.delta_target)
            if not 0.0 <= self.delta_target <= self.delta_max:
                raise ValueError(
                    f"delta_target ({self.delta_target}) must lie in "
                    f"[0, delta_max={self.delta_max}]"
                )
        if self.k_max is not None:
            check_int("k_max", self.k_max, minimum=self.budget)

    def _check_auto(self) -> None:
        if self.tau != AUTO_TAU:
            if self.target_rho is not None or self.prompt_queries is not None:
                raise ValueError(
                    "target_rho and prompt_queries apply to tau='auto' (a threshold calibrated "
                    f"on the prompt); tau is {self.tau!r}"
                )
            return
        if self.target_rho is not None:
            check_probability("target_rho", self.target_rho)
            if not 0.0 < self.target_rho <= 1.0:
                raise ValueError(f"target_rho must lie in (0, 1], got {self.target_rho}")
        if self.prompt_queries is not None:
            check_int("prompt_queries", self.prompt_queries, minimum=2)

    @property
    def auto_tau(self) -> bool:
        """Whether ``tau`` is calibrated on each prompt (``tau="auto"``)."""
        return self.tau == AUTO_TAU

    @property
    def auto_target_rho(self) -> float:
        """The mean retrieval ratio ``tau="auto"`` aims at."""
        if self.target_rho is not None:
            return self.target_rho
        return DEFAULT_TARGET_RHO_RESCORE if self.rescore_positions else DEFAULT_TARGET_RHO

    @property
    def rescore_positions(self) -> int:
        """The pool a retrieval keeps beyond its ``k`` for the reuses to re-rank (positions; 0:
        none): ``rescore``, or with ``None`` ``2·k`` in paper mode and 0 in certified mode."""
        if self.rescore is not None:
            return self.rescore
        return 0 if self.certified else DEFAULT_RESCORE_FACTOR * self.budget

    @property
    def key_codes(self) -> bool:
        """Whether retrievals and re-rankings score the side cache of 4-bit keys
        (``scorer="int4"``; ``None`` means ``"int4"`` in paper mode, ``"exact"`` in certified
        mode)."""
        return self.scorer == "int4" or (self.scorer is None and not self.certified)

    @property
    def auto_queries(self) -> int:
        """How many prompt queries ``tau="auto"`` replays."""
        return self.prompt_queries if self.prompt_queries is not None else DEFAULT_PROMPT_QUERIES

    @property
    def certified(self) -> bool:
        """Whether the certificate gates reuse."""
        return self.delta_max is not None

    @property
    def page_certified(self) -> bool:
        """Whether the per-page certificate gates reuse."""
        return self.certified and (self.certificate or "page") == "page"

    @property
    def page_size(self) -> int:
        """Positions per page of the per-page certificate."""
        return self.certificate_page or DEFAULT_CERTIFICATE_PAGE

    @property
    def retrieval_target(self) -> float:
        """Top-p dropped-mass target of a certified retrieval."""
        assert self.delta_max is not None
        return self.delta_target if self.delta_target is not None else self.delta_max / 2

    @property
    def retrieval_cap(self) -> int:
        """Cap of a certified retrieval's set, in positions."""
        return self.k_max if self.k_max is not None else 4 * self.budget


def _token_mask(parts: list[torch.Tensor], s: int, t: int, lens: torch.Tensor) -> torch.Tensor:
    """``[B, H, T]`` bool: the positions of the blocks listed in ``parts`` (``[B, H, w]`` or
    ``[B, w]``, ``-1`` for none), clipped to each length."""
    b = lens.shape[0]
    h = max(p.shape[1] for p in parts if p.ndim == 3)
    ids = torch.cat([(p if p.ndim == 3 else p.unsqueeze(1)).expand(b, h, -1) for p in parts], -1)
    nb = -(-t // s)
    blocks = torch.zeros(b, h, nb + 1, dtype=torch.bool, device=ids.device)
    blocks.scatter_(-1, torch.where(ids >= 0, ids.long().clamp(max=nb), nb), True)
    mask = blocks[..., :nb].repeat_interleave(s, dim=-1)[..., :t]
    pos = torch.arange(t, device=ids.device).view(1, 1, -1)
    return mask & (pos < lens.view(-1, 1, 1))


@selectors.register(
    "cis", config=CISConfig, summary="PrHS time axis: reuse an anchor's critical set"
)
class CIS(BaseSelector):
    """Critical-Index Sharing (Gao et al., "Near-Oracle KV Selection via Pre-hoc Sparsity for
    Long-Context Inference", arXiv:2602.08329), in paper or certified mode; see the module
    docstring for the rules and :class:`CISConfig` for the hyperparameters.

    Per-request state (per layer and KV head), independent of the context length: the anchor's
    queries ``[g, D]``, its length ``t_a``, its critical blocks as an index list ordered by
    anchor score (so the top ``m`` are its first ``m`` entries), ``log δ_a`` and ``K_max``.

    The selection's static width is ``ws + M + 2·r·m + wl`` entries: the sink and local
    windows, the anchor list (``M = k/s`` blocks, or the certified cap) and its dilation. With
    ``hold_local`` (the default), ``wl`` spans ``2·n_local`` positions: a reuse reads the local
    window from where its anchor's started.
    """

    name = "cis"
    config_type = CISConfig
    config: CISConfig

    @property
    def certifies(self) -> bool:  # type: ignore[override]
        return self.config.certified

    def anchor_width(self) -> int:
        """``M``: entries of an anchor list (``k/s`` blocks, or the certified cap in blocks)."""
        c = self.config
        if c.certified:
            return max(1, c.retrieval_cap // c.block_size)
        return self.budget_blocks()

    def rescore_blocks(self) -> int:
        """``R``: the next-best blocks an anchor keeps for its reuses to re-rank (0: none)."""
        return -(-self.config.rescore_positions // self.config.block_size)

    def dilation_m(self) -> int:
        """``m = ⌊(k/s) / n_den⌋``: how many of the anchor's top blocks are dilated."""
        return self.budget_blocks() // self.config.n_den

    def union_m(self) -> int:
        """The ``m`` a composition dilates: :meth:`dilation_m`, or 0 under RandomExpansion
        (which adds its random blocks after composing)."""
        c = self.config
        random = c.expansion == "random" and c.r * self.dilation_m() > 0
        return 0 if random else self.dilation_m()

    def keeps_union(self) -> bool:
        """Whether each anchor also stores its reuses' ``S_a ∪ dilate(S_a)`` (the fields
        ``anchor_union`` / ``anchor_ucnt``), which the Triton composition of a reusing row
        copies instead of sorting: paper mode without ``rescore`` (which rewrites the list at
        every reuse)."""
        return not self.config.certified and not self.rescore_blocks()

    def selection_width(self) -> int:
        c = self.config
        ws, _ = self.window_widths()
        wl = cis_local_width(c.n_local, c.block_size, c.hold_local)
        return ws + self.anchor_width() + 2 * c.r * self.dilation_m() + wl

    @property
    def state_per_location(self) -> bool:  # type: ignore[override]
        """The per-page certificate keeps the anchor's masses per KV page: a page shared by
        two requests (a prefix cache) would mix them."""
        return self.config.page_certified

    def side_page_size(self) -> int:
        """The per-page certificate's page (1 otherwise)."""
        return self.config.page_size if self.config.page_certified else 1

    def uses_side_cache(self) -> bool:
        """The per-page certificate keeps each page's key minima and maxima; paper mode with
        ``scorer="int4"`` each key's code row."""
        return self.config.page_certified or self.config.key_codes

    def key_codes(self, state: SelectorState, layer: int) -> KeyCodes | None:
        """``layer``'s code rows as the scorers read them (``None`` without them)."""
        if not self.config.key_codes:
            return None
        assert state.side is not None
        side = state.side
        return KeyCodes(side["cis_codes"][:, layer], state.row_stride, side["cis_center"][layer])

    def set_key_center(self, state: SelectorState, center: torch.Tensor) -> None:
        """Pin the centre ``center [num_layers, Hkv, D]`` (float, finite) that every code row
        of ``state`` is taken around, before its first key is written (paper mode with key
        codes: ``scorer="int4"``, the default). Without it, the first write of at least
        :data:`MIN_CENTER_KEYS` keys to each layer fixes that layer's centre
        (:func:`prhs_kernels.keycodes.key_center` of that write; codes written before it are
        taken around 0), so a state's codes depend on which prompts it was given first; with
        it, every request's codes are a function of its own keys, whichever requests came
        before or beside it. A centre from one calibration prompt serves (e.g. ``key_center``
        of its keys per layer): on the 4k perplexity runs, another text's centre gave the
        window's own beta. Host checks (a setup call, never inside a step)."""
        if not self.config.key_codes or state.side is None:
            raise ValueError(
                "set_key_center applies to paper mode with key codes (scorer='int4', the "
                "default); this selector scores the exact keys (scorer='exact' or certified mode)"
            )
        table = state.side["cis_center"]
        check_float_tensor("center", center, ndim=3)
        if tuple(center.shape) != tuple(table.shape):
            n_l, h, d = table.shape
            raise ValueError(
                f"center must be [num_layers={n_l}, Hkv={h}, D={d}], got {list(center.shape)}"
            )
        check_values_finite("center", center)
        n_layers = table.shape[0]
        done = state.side.initialized
        written = [i for i in range(n_layers) if f"cis_codes/{i}" in done]
        if written:
            raise ValueError(
                f"set_key_center must come before the first key is written: layer(s) {written} "
                "already coded keys around their centre (pin it right after init_state)"
            )
        table.copy_(center.to(device=table.device, dtype=torch.float32))
        done.update(f"cis_center/{i}" for i in range(n_layers))

    def counts_nonfinite_keys(self) -> bool:
        # The fold finds and counts the non-finite keys (in its one launch on a Triton path).
        return True

    def write_side(
        self,
        state: SelectorState,
        layer: int,
        locations: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        finite: torch.Tensor | None,
        *,
        columns: torch.Tensor | None = None,
    ) -> None:
        assert state.side is not None
        path = self.kernel_path(key.device, key.dtype)
        if self.config.key_codes:
            side = state.side
            center = side["cis_center"][layer]
            fixed = f"cis_center/{layer}" in side.initialized
            if not fixed and locations.shape[0] >= MIN_CENTER_KEYS:
                # The first write of at least MIN_CENTER_KEYS keys to the layer (a prompt's)
                # fixes the centre its codes are taken around, for every later write and request
                # (host bookkeeping: the write's row count, no device read).
                center.copy_(key_center(locations, key, columns=columns))
                side.initialized.add(f"cis_center/{layer}")
            side.initialized.add(f"cis_codes/{layer}")  # set_key_center comes too late now
            write_key_codes(
                side["cis_codes"][:, layer], locations, key, columns=columns, finite=finite,
                nonfinite=state.nonfinite if finite is None else None, center=center, path=path,
            )  # fmt: skip
            return
        fold_page_bounds(
            state.side, "cis_kmin", "cis_kmax", layer, locations, key, finite, columns=columns,
            nonfinite=state.nonfinite if finite is None else None, path=path,
        )  # fmt: skip

    def init_fields(self, state: SelectorState, spec: AttentionSpec, kv_dtype: torch.dtype) -> None:
        n_l, h, g, d = spec.num_layers, spec.num_kv_heads, spec.group_size, spec.head_dim
        # A table goes to the device now, never inside a captured step.
        self._tau_list = self._tau_rows(n_l, h)
        self._tau_tables: dict[str, torch.Tensor] = {}
        self._grid: dict[torch.device, torch.Tensor] = {}
        if self._tau_list is not None:
            self.layer_tau(0, state.device)
        m = self.anchor_width()
        pool = state.pool
        pool.add_field("anchor_q", (n_l, h, g, d), torch.float32)
        pool.add_field("anchor_len", (n_l, h), torch.int32, 0)
        pool.add_field("anchor_idx", (n_l, h, m), torch.int32, -1)
        pool.add_field("anchor_cnt", (n_l, h), torch.int32, 0)
        if self.rescore_blocks():
            pool.add_field("anchor_next", (n_l, h, self.rescore_blocks()), torch.int32, -1)
        if self.keeps_union():
            width = m + 2 * self.config.r * self.union_m()
            pool.add_field("anchor_union", (n_l, h, width), torch.int32, -1)
            pool.add_field("anchor_ucnt", (n_l, h), torch.int32, 0)
        if self.config.certified:
            # Per query head: the certificate bounds each head's dropped mass.
            pool.add_field("anchor_log_delta", (n_l, h, g), torch.float64, 0.0)
            pool.add_field("anchor_kmax", (n_l, h), torch.float32, 0.0)
        else:  # cis_compose writes it; paper mode never reads it
            pool.add_field("anchor_log_delta", (n_l, h), torch.float64, 0.0)
        if self.config.key_codes:
            # One code row per (location, layer, KV head), and per (layer, KV head) the centre
            # the rows are coded around (pinned, or set by the first write of MIN_CENTER_KEYS
            # keys or more).
            assert state.side is not None
            state.side.add_field("cis_codes", (n_l, h, code_bytes(d)), torch.uint8, 0)
            state.side.add_table("cis_center", (n_l, h, d), torch.float32, 0.0)
        if self.config.page_certified:
            # Per page of the side cache: the keys' box, and the anchor's masses outside /
            # inside its set per query head (log, float32 rounded outward).
            assert state.side is not None
            state.side.add_page_field("cis_kmin", (n_l, h, d), kv_dtype, float("inf"))
            state.side.add_page_field("cis_kmax", (n_l, h, d), kv_dtype, float("-inf"))
            state.side.add_page_field("cis_page_logm", (n_l, h, g, 2), torch.float32, NEG_INF)
        if self.config.auto_tau:
            # The calibrated thresholds, and each layer's replayed curves until all are seen.
            k = len(TAU_GRID)
            pool.add_field("tau", (n_l, h), torch.float32, FALLBACK_TAU)
            pool.add_field("tau_beta", (n_l, h, k), torch.float32, -1.0)  # -1: not seen
            pool.add_field("tau_rho", (n_l, h, k), torch.float32, -1.0)

    def _tau_rows(self, num_layers: int, num_kv_heads: int) -> list[list[float]] | None:
        """The ``tau`` table as ``num_layers`` rows of ``num_kv_heads`` thresholds (``None`` for
        one ``tau``); a table that does not fit the model is an error."""
        tau = self.config.tau
        if isinstance(tau, float | str):
            return None
        widths = {len(row) for row in tau}
        if len(tau) != num_layers or not widths <= {1, num_kv_heads}:
            raise ValueError(
                f"tau table of {len(tau)} row(s) of width {sorted(widths)} does not fit this "
                f"model: it needs {num_layers} rows (one per layer), each of 1 or "
                f"{num_kv_heads} (KV heads) thresholds"
            )
        return [list(row) * num_kv_heads if len(row) == 1 else list(row) for row in tau]

    def layer_tau(
        self, layer: int, device: torch.device | str, state: SelectorState | None = None
    ) -> float | torch.Tensor:
        """``τ`` of ``layer``: the float; the table's row as ``[Hkv]`` float32 on ``device``
        (copied there once, at :meth:`init_state` for the state's device); or, with
        ``tau="auto"``, ``state``'s calibrated thresholds ``[N, Hkv]`` (rows by slot)."""
        tau = self.config.tau
        if isinstance(tau, float):
            return tau
        if isinstance(tau, str):
            if state is None:
                raise ValueError("tau='auto' keeps its thresholds in the state: pass state=")
            return state.pool["tau"][:, layer]
        key = str(torch.device(device))
        if key not in self._tau_tables:
            self._tau_tables[key] = torch.tensor(self._tau_list, dtype=torch.float32, device=device)
        return self._tau_tables[key][layer]

    # -- the step ---------------------------------------------------------------------------
    def select_layer(
        self,
        plan: DecodePlan,
        layer: int,
        query: torch.Tensor,
        kv: KVLayout,
        state: SelectorState,
        bad: torch.Tensor | None,
    ) -> Selection | None:
        if self.config.certified:
            assert bad is not None
            return self._select_certified(plan, layer, query, kv, state, bad)
        return self._select_paper(plan, layer, query, kv, state)

    def finds_nonfinite_queries(self) -> bool:
        """Paper mode: :func:`prhs_kernels.cis.cis_decide` finds and counts them."""
        return not self.config.certified

    def kernel_path(self, device: torch.device | str, dtype: torch.dtype) -> str:
        """The path of the paper-mode step (:func:`prhs_kernels.cis.cis_path`): ``"triton"``
        (the fused decide / score / compose kernels), ``"triton-interpreter"`` or ``"torch"``.
        Certified mode runs torch (float64 certificate quantities)."""
        if self.config.certified:
            return "torch"
        return cis_path(device, dtype, self.config.block_size)

    # -- the prompt: tau="auto" ---------------------------------------------------------------
    def prompt_queries(self) -> int:
        """How many of a prompt's last queries :meth:`observe_prompt` wants per layer (0: none,
        ``tau`` is fixed)."""
        c = self.config
        return c.auto_queries if c.auto_tau and c.require_cosine else 0

    def replay_config(self) -> ReplayConfig:
        """The hyperparameters a calibration replays (this selector's)."""
        c = self.config
        return ReplayConfig(
            budget=c.budget,
            n_sink=c.n_sink,
            n_local=c.n_local,
            block_size=c.block_size,
            block_score=c.block_score,
            n_den=c.n_den,
            r=c.r,
            hold_local=c.hold_local,
            rescore_blocks=self.rescore_blocks(),
        )

    def observe_prompt(
        self,
        state: SelectorState,
        layer: int,
        slots: list[int] | tuple[int, ...],
        queries: torch.Tensor,
        kv: ContiguousKV,
        scaling: float,
        bounds: Sequence[tuple[int, int]] | None = None,
        locations: torch.Tensor | None = None,
    ) -> None:
        """``tau="auto"``: calibrate ``layer``'s thresholds on a prompt (a no-op otherwise).

        The host calls this at prefill, after the layer's K/V are written, with the last ``W``
        queries of each prompt (``queries [B, W, Hq, D]`` after RoPE, ``2 ≤ W ≤``
        :meth:`prompt_queries`; query ``i`` of row ``b`` sits at position ``len_b − W + i``),
        the prompt's cache ``kv`` (``B`` rows, lengths = the prompts') and the host slots
        ``slots`` (ints) of the rows' requests. Every selectable layer is observed, in order;
        the call for the last one sets each slot's thresholds from all of them
        (:func:`prhs_selectors.cis_calibration.choose_tau`). A prompt shorter than
        ``W + n_sink + n_local + budget + block_size`` keeps the fallback 0.72 (it drops no
        position a replay could measure). In paper mode the prompt's last query, which the
        replay scored against every key, also becomes each calibrated row's anchor, so the
        first decode step may reuse its set instead of retrieving. A later prompt into the same
        slot (the next chunk of a chunked prefill) calibrates again. ``bounds``: each row's
        ``(start, length)`` in ``kv`` as host ints, which the host knows; without them they are
        read from ``kv`` (a device read, which keeps the host from running ahead of the GPU).
        Nothing else is read on the host: the choice of thresholds stays on the device.
        """
        if not self.prompt_queries():
            return
        spec = self._spec()
        ids, bounds = self.check_prompt_observation(
            state, layer, slots, queries, kv, scaling, bounds
        )
        b, h, d = kv.batch_size, spec.num_kv_heads, spec.head_dim
        w = queries.shape[1]
        cfg = self.replay_config()
        taus = self._grid.get(kv.k.device)
        if taus is None:
            taus = torch.tensor(TAU_GRID, dtype=torch.float32, device=kv.k.device)
            self._grid[kv.k.device] = taus
        beta = torch.full((b, h, len(TAU_GRID)), -1.0, device=kv.k.device)  # -1: too short
        rho = torch.full_like(beta, -1.0)
        seeds = []  # (row, slot, last top): the prompt's last query becomes the anchor
        for i, (st, n) in enumerate(bounds):
            if n < cfg.min_prompt_len(w):
                continue
            keys = kv.k[i, :, st : st + n]
            replay = replay_curves(queries[i], keys, float(scaling), cfg, taus)
            beta[i], rho[i] = replay.beta, replay.rho
            seeds.append((i, ids[i], n, replay.last_top, replay.last_next))
        pool = state.pool
        idx = torch.tensor(ids, dtype=torch.long, device=pool.device)
        pool["tau_beta"][idx, layer] = beta.to(pool.device)
        pool["tau_rho"][idx, layer] = rho.to(pool.device)
        if not self.config.certified:  # certified anchors also need δ_a and K_max: not seeded
            g = spec.group_size
            for i, slot, n, top, after in seeds:
                q_last = queries[i, -1].float().reshape(h, g, d)
                pool["anchor_q"][slot, layer] = q_last.to(pool.device)
                pool["anchor_len"][slot, layer] = n
                pool["anchor_idx"][slot, layer] = top.to(pool.device, torch.int32)
                pool["anchor_cnt"][slot, layer] = (top >= 0).sum(-1).to(pool.device, torch.int32)
                if self.keeps_union():  # what the reuses of this anchor copy
                    union, u_cnt = anchor_union_reference(
                        pool["anchor_idx"][slot, layer], pool["anchor_cnt"][slot, layer],
                        self.union_m(), self.config.r,
                    )  # fmt: skip
                    pool["anchor_union"][slot, layer] = union
                    pool["anchor_ucnt"][slot, layer] = u_cnt
                if self.rescore_blocks():
                    pool["anchor_next"][slot, layer] = after.to(pool.device, torch.int32)
        if layer == max(spec.selectable_layers):
            n_l = spec.num_layers
            curves = [pool[f][idx].reshape(b, n_l * h, -1) for f in ("tau_beta", "tau_rho")]
            tau = choose_tau(
                *curves, taus.to(pool.device), self.config.auto_target_rho, FALLBACK_TAU
            )
            pool["tau"][idx] = tau.view(b, n_l, h)

    def _select_paper(
        self,
        plan: DecodePlan,
        layer: int,
        query: torch.Tensor,
        kv: KVLayout,
        state: SelectorState,
    ) -> Selection:
        """Paper mode through :mod:`prhs_kernels.cis`: decide, re-rank the reusing rows' pools
        (``rescore``), score the retrieving rows' blocks, take their top ``k/s`` (and the next
        ``R``), compose and update the anchors. With the anchors' unions (no ``rescore``, no
        random expansion) the decision's launch writes the reusing rows' selections itself
        (:func:`prhs_kernels.cis.cis_decide_compose`) and the retrieval scores, ranks and composes
        the retrieving rows (:func:`prhs_kernels.cis.retrieval_compose`: by block mass on a
        Triton path, two launches, the composition in the top-k's). In a captured step the
        retrieval's kernels (and then that composition) sit in a conditional node
        (:func:`prhs_kernels.graphs.run_if`) that a replay skips when no row retrieves
        (``state.retrieving``, set by the decision, cleared by the composition)."""
        c = self.config
        pool, slots = state.pool, plan.slots
        path = self.kernel_path(query.device, kv.dtype)
        codes = self.key_codes(state, layer)
        anchor = {n: pool[n][:, layer] for n in _ANCHOR_FIELDS}
        sel = plan.selection
        random = c.expansion == "random" and c.r * self.dilation_m() > 0
        union = {}
        if self.keeps_union():
            union = dict(anchor_union=pool["anchor_union"][:, layer],
                         anchor_union_cnt=pool["anchor_ucnt"][:, layer])  # fmt: skip
        # With the anchors' unions (and no random expansion) the decision's launch also writes
        # every non-retrieving row's selection; the retrieving rows are composed by the
        # retrieval (retrieval_compose), inside the retrieval's conditional node.
        early = bool(union) and not random
        decide_args = (query, anchor["anchor_q"], anchor["anchor_len"])
        decide_kw = dict(
            tau=self.layer_tau(layer, query.device, state), n_local=c.n_local,
            nonfinite=state.nonfinite, any_retrieve=state.retrieving, path=path,
        )  # fmt: skip
        if early:
            retrieve, bad = cis_decide_compose(
                *decide_args, anchor["anchor_idx"], anchor["anchor_cnt"], union["anchor_union"],
                union["anchor_union_cnt"], slots, kv.seq_lens, **decide_kw, n_sink=c.n_sink,
                block_size=c.block_size, m=self.union_m(), r=c.r, out_indices=sel.indices,
                out_counts=sel.counts, hold_local=c.hold_local,
            )  # fmt: skip
        else:
            retrieve, bad = cis_decide(*decide_args, slots, kv.seq_lens, **decide_kw)
        n_next = self.rescore_blocks()
        side = None
        if n_next:
            anchor_next = pool["anchor_next"][:, layer]
            # ~retrieve & ~bad in one launch, not three: a bad row never retrieves
            # (cis_decide), so the two flags are equal only where both are false. Alive
            # until the join below (read on the side stream).
            reuse = retrieve == bad
            # The re-ranking writes the reusing rows' pools, the retrieval reads and writes the
            # retrieving rows': disjoint, so on a GPU the re-ranking may run on a side stream
            # (prhs_kernels.graphs.SIDE_STREAMS), beside the retrieval (a parallel branch of a
            # captured step), joined before the composition reads both. Not the torch path:
            # its writes rewrite every row at the batch's slots.
            with forked(query.device) if path.startswith("triton") else nullcontext() as side:
                cis_rescore(
                    query,
                    kv,
                    plan.scaling,
                    reuse,
                    anchor["anchor_len"],
                    anchor["anchor_idx"],
                    anchor["anchor_cnt"],
                    anchor_next,
                    slots,
                    block_size=c.block_size,
                    n_sink=c.n_sink,
                    n_local=c.n_local,
                    hold_local=c.hold_local,
                    score=c.block_score,
                    codes=codes,
                    path=path,
                )
        m_width = self.anchor_width()
        compose_kw = dict(
            n_sink=c.n_sink, n_local=c.n_local, block_size=c.block_size, m=self.union_m(),
            r=c.r, hold_local=c.hold_local, any_retrieve=state.retrieving, **union, path=path,
        )  # fmt: skip
        # Only the retrieving rows' entries of new_idx / new_scores are read (by cis_compose),
        # so a replay that skips these kernels when no row retrieves changes nothing.
        with run_if(state.retrieving):
            if early:  # scored, ranked and composed, the retrieving rows only
                retrieval_compose(
                    query, kv, plan.scaling, m_width, retrieve, bad,
                    *(anchor[n] for n in _ANCHOR_FIELDS), slots, score=c.block_score,
                    out_indices=sel.indices, out_counts=sel.counts, codes=codes, **compose_kw,
                )  # fmt: skip
            else:
                scores = retrieval_block_scores(
                    query,
                    kv,
                    plan.scaling,
                    retrieve,
                    block_size=c.block_size,
                    n_sink=c.n_sink,
                    n_local=c.n_local,
                    score=c.block_score,
                    fill_idle=False,  # ranked below for the retrieving rows only
                    codes=codes,
                    path=path,
                )
                if n_next:  # the retrieving rows' anchors also keep their next-best blocks
                    # On a GPU the row's current pool (read in place at its slot) seeds the
                    # ranking (guess, verify, refine).
                    new_idx, new_scores = retrieval_pool(
                        scores, m_width, n_next, retrieve, anchor_next, slots,
                        anchor_idx=anchor["anchor_idx"], path=path,
                    )  # fmt: skip
                else:
                    new_idx, new_scores = top_blocks(scores, m_width, retrieve, path=path)
        join(side)
        if random:  # compose without dilation, then add the random blocks
            n_extra = 2 * c.r * self.dilation_m()
            out_idx = sel.indices.new_empty((*sel.indices.shape[:-1], sel.width - n_extra))
            out_cnt = torch.empty_like(sel.counts)
            reused = ~retrieve & ~bad  # before cis_compose makes the retrieving rows anchors
        else:
            out_idx, out_cnt = sel.indices, sel.counts
        if not early:
            cis_compose(
                query,
                retrieve,
                bad,
                new_idx,
                new_scores,
                *(anchor[n] for n in _ANCHOR_FIELDS),
                slots,
                kv.seq_lens,
                out_indices=out_idx,
                out_counts=out_cnt,
                **compose_kw,
            )
        if random:
            n_blocks = self.num_blocks(kv)
            extra = random_blocks(kv.seq_lens, n_blocks, slots, layer, out_cnt.shape[1], n_extra)
            extra = torch.where(reused.unsqueeze(-1), extra, -1)
            union_indices([out_idx, extra], n_blocks, sel.indices, sel.counts)
        if plan.stats is not None:
            hq, d = query.shape[1:]
            reuse_bytes = float(hq // kv.num_kv_heads * d * 4)
            if n_next:  # the pool's keys (or their codes) and the windows' scored again
                wl = 2 * c.n_local if c.hold_local else c.n_local
                rows = (m_width + n_next) * c.block_size + c.n_sink + wl
                reuse_bytes += float(rows * self.key_row_bytes(kv))
            proxy = torch.where(retrieve, self.retrieval_bytes(kv), reuse_bytes)
            self.record(plan, layer, kv, sel, retrieve, proxy, None)
        return sel

    def key_row_bytes(self, kv: KVLayout) -> int:
        """Bytes a retrieval or re-ranking reads per cached key: its code row with
        ``scorer="int4"``, else the key in the cache dtype."""
        if self.config.key_codes:
            return code_bytes(kv.head_dim)
        return super().key_row_bytes(kv)

    def _select_certified(
        self,
        plan: DecodePlan,
        layer: int,
        query: torch.Tensor,
        kv: KVLayout,
        state: SelectorState,
        bad: torch.Tensor,
    ) -> Selection:
        """Certified mode, in torch: the certificate's quantities are float64."""
        c = self.config
        b, hq, d = query.shape
        h = kv.num_kv_heads
        g = hq // h
        s = c.block_size
        m_width = self.anchor_width()
        pool, slots = state.pool, plan.slots
        lens = kv.seq_lens.view(-1, 1)  # [B, 1] int32

        q = query.reshape(b, h, g, d).float()
        qa = pool["anchor_q"][:, layer][slots]
        ta = pool["anchor_len"][:, layer][slots]
        a_idx = pool["anchor_idx"][:, layer][slots]
        a_cnt = pool["anchor_cnt"][:, layer][slots]

        reuse = (ta > 0) & (lens - ta <= c.n_local) & (lens >= ta)
        if c.require_cosine:
            cos = torch.nn.functional.cosine_similarity(q.flatten(-2), qa.flatten(-2), dim=-1)
            tau = self.layer_tau(layer, query.device, state)
            if isinstance(tau, torch.Tensor):
                tau = tau[slots] if tau.ndim == 2 else tau.view(1, -1)
            reuse &= cos >= tau
        pages = None
        if c.page_certified:
            pages = self._pages(kv, state)
            log_dhat_h, check_bytes = self._page_certificate(
                plan, layer, q, qa, ta, kv, state, pages
            )
        else:
            log_dhat_h, check_bytes = self._global_certificate(plan, layer, q, qa, ta, kv, state)
        log_dhat = log_dhat_h.amax(-1)  # [B, H]: every query head of the group
        reuse &= log_dhat <= math.log(c.delta_max)  # type: ignore[arg-type]
        reuse &= ~bad
        retrieve = ~reuse & ~bad

        # A reuse reads sink ∪ dilate(S_a) ∪ local.
        used = torch.arange(m_width, device=lens.device) < a_cnt.unsqueeze(-1)
        reuse_part = torch.cat(
            [torch.where(used, a_idx, -1), dilate_indices(a_idx, a_cnt, self.dilation_m(), c.r)],
            -1,
        )

        # A retrieval scores every key (of the retrieving rows) and reads sink ∪ S_new ∪ local.
        # What the bound rests on (the anchor's per-head masses, a retrieval's own δ): float64.
        logits64 = score_keys(query, kv, plan.scaling, dtype=torch.float64)  # [B, H, g, T]
        new_idx, new_cnt = self._retrieve_certified(kv, logits64, bad)
        pad = reuse_part.shape[-1] - m_width
        new_part = torch.nn.functional.pad(new_idx, (0, pad), value=-1)
        part = torch.where(retrieve.unsqueeze(-1), new_part, reuse_part)
        part = part.masked_fill(bad.unsqueeze(-1), -1)  # a skipped row reads its windows only
        sink, local = self.windows(kv)
        if c.hold_local:
            held = held_local_indices(local, kv.seq_lens, ta, reuse, c.n_local, s)
            sel = self.compose(plan, kv, part, held)
        else:
            sel = self.compose(plan, kv, part)

        t = kv.max_len
        dil = dilate_indices(new_idx, new_cnt, self.dilation_m(), c.r)
        # The anchor's set: every later reuse reads it (the local window too under hold_local,
        # as the held window starts where the anchor's did).
        kept_parts = [new_idx, dil, sink] + ([local] if c.hold_local else [])
        anchor_keep = _token_mask(kept_parts, s, t, kv.seq_lens)
        read = _token_mask([new_idx, sink, local], s, t, kv.seq_lens)
        exact_h = _head_log_dropped_mass(logits64, read)  # [B, H, g]
        exact = exact_h.amax(-1).exp()
        delta_hat = round_to_float32(torch.where(retrieve, exact, log_dhat.exp()), up=True)
        # A retrieval whose top-p set the cap cut: what it reads drops more than its target for
        # some head. (The set's masses are float64 sums: a relative slack of 1e-9.)
        missed = retrieve & (exact > c.retrieval_target * (1 + 1e-9))

        r = retrieve
        pool["anchor_q"][:, layer][slots] = torch.where(r[..., None, None], q, qa)
        pool["anchor_len"][:, layer][slots] = torch.where(r, lens, ta)
        pool["anchor_idx"][:, layer][slots] = torch.where(r.unsqueeze(-1), new_idx, a_idx)
        pool["anchor_cnt"][:, layer][slots] = torch.where(r, new_cnt, a_cnt)
        if c.page_certified:
            assert state.side is not None and pages is not None
            m_drop, m_sel = page_log_masses(
                logits64, anchor_keep.unsqueeze(2), c.page_size, check=False
            )  # [B, H, g, P] each
            stored = torch.stack(
                [round_to_float32(m_drop, up=True), round_to_float32(m_sel, up=False)], -1
            ).permute(0, 3, 1, 2, 4)  # [B, P, H, g, 2]
            field = state.side["cis_page_logm"][:, layer]  # [pages + 1, H, g, 2], a view
            old = field[pages]
            field[pages] = torch.where(r[:, None, :, None, None], stored, old)
        else:
            a_logd = pool["anchor_log_delta"][:, layer][slots]
            log_d_anchor = _head_log_dropped_mass(logits64, anchor_keep)
            pool["anchor_log_delta"][:, layer][slots] = torch.where(
                r.unsqueeze(-1), log_d_anchor, a_logd
            )
            a_kmax = pool["anchor_kmax"][:, layer][slots]
            new_kmax = round_to_float32(max_key_norm(kv).double(), up=True)
            pool["anchor_kmax"][:, layer][slots] = torch.where(r, new_kmax, a_kmax)

        proxy = torch.where(retrieve, self.retrieval_bytes(kv), check_bytes)
        self.record(plan, layer, kv, sel, retrieve, proxy, delta_hat, missed)
        return sel

    def _global_certificate(
        self,
        plan: DecodePlan,
        layer: int,
        q: torch.Tensor,
        qa: torch.Tensor,
        ta: torch.Tensor,
        kv: KVLayout,
        state: SelectorState,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``log δ̂ [B, H, g]`` of the global certificate, and the bytes its check reads."""
        c = self.config
        pool, slots = state.pool, plan.slots
        lens = kv.seq_lens.view(-1, 1)
        # K_max over every key: the anchor's, and the (at most n_local + 1) keys since.
        offs = torch.arange(c.n_local + 1, device=lens.device, dtype=torch.int32)
        new_pos = ta.unsqueeze(-1) + offs  # [B, H, n_local + 1]
        new_pos = torch.where(new_pos < lens.unsqueeze(-1), new_pos, -1)
        new_keys, _ = gather_kv(kv, new_pos, values=False)
        a_kmax = pool["anchor_kmax"][:, layer][slots]
        kmax = torch.maximum(a_kmax.double(), new_keys.double().norm(dim=-1).amax(-1))
        d = q.shape[-1]
        # Per query head, in float64 (the queries are cast so that the result stays float64).
        eps = logit_shift_bound(
            q.double(), qa.double(), kmax.unsqueeze(-1), plan.scaling, check=False
        )
        a_logd = pool["anchor_log_delta"][:, layer][slots]
        log_dhat = log_reuse_certificate(a_logd, eps, check=False)
        elem = torch.empty((), dtype=kv.dtype).element_size()
        g = q.shape[2]
        meta = float((c.n_local + 1) * d * elem + g * d * 4 + g * 8 + 4)
        return log_dhat, torch.full_like(a_kmax, meta, dtype=torch.float64)

    def _pages(self, kv: KVLayout, state: SelectorState) -> torch.Tensor:
        """``[B, P]`` side-cache page rows of each sequence's pages (scratch past the end)."""
        assert state.side is not None
        p = self.config.page_size
        n_pages = -(-kv.max_len // p)
        first = torch.arange(n_pages, device=kv.seq_lens.device) * p
        b = kv.batch_size
        loc = token_locations(kv, first.view(1, -1).expand(b, -1), state.row_stride)
        return state.side.pages_of(loc)

    def _page_certificate(
        self,
        plan: DecodePlan,
        layer: int,
        q: torch.Tensor,
        qa: torch.Tensor,
        ta: torch.Tensor,
        kv: KVLayout,
        state: SelectorState,
        pages: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``log δ̂ [B, H, g]`` of the per-page certificate, and the bytes its check reads: each
        anchor page's key box (``2·D`` cache elements) and the anchor's two masses per query
        head, plus the anchor's queries."""
        side = state.side
        assert side is not None
        p = self.config.page_size
        _, _, g, d = q.shape
        kmin = side["cis_kmin"][:, layer][pages].permute(0, 2, 1, 3).unsqueeze(2)
        kmax = side["cis_kmax"][:, layer][pages].permute(0, 2, 1, 3).unsqueeze(2)
        lower, upper = page_box_shift_bounds(q, qa, kmin, kmax, plan.scaling, check=False)
        logm = side["cis_page_logm"][:, layer][pages].permute(0, 2, 3, 4, 1)  # [B, H, g, 2, P]
        # Only the anchor's pages hold its masses (later ones may hold a former request's).
        first = torch.arange(pages.shape[1], device=ta.device) * p
        mine = (first.view(1, 1, -1) < ta.unsqueeze(-1)).unsqueeze(2)  # [B, H, 1, P]
        drop = torch.where(mine, logm[..., 0, :], NEG_INF)
        kept = torch.where(mine, logm[..., 1, :], NEG_INF)
        log_dhat = log_page_reuse_certificate(drop, kept, lower, upper, check=False)
        elem = torch.empty((), dtype=kv.dtype).element_size()
        pages_used = (ta.double() + p - 1) // p
        meta = pages_used * (2 * d * elem + 2 * g * 4) + g * d * 4 + 4
        return log_dhat, meta

    def _retrieve_certified(
        self, kv: KVLayout, logits64: torch.Tensor, bad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A certified retrieval's ``S_a``: ``(indices [B, H, M], counts [B, H])``, the list
        ordered by block score (``block_score``: max group probability or mass), largest
        first.

        The set: blocks ranked by their group-mean mass, the shortest prefix after which every
        query head's dropped mass (the sink kept) is at most ``delta_target``, capped at ``M``
        blocks; only the sink is left out of the candidates."""
        c = self.config
        s = c.block_size
        b, h, g, _ = logits64.shape
        probs_h = torch.softmax(logits64, dim=-1)  # [B, H, g, T] float64, 0 past the end
        mass_h = block_reduce(probs_h.flatten(1, 2), s, "sum").view(b, h, g, -1)
        group = probs_h.mean(2)
        block_scores = block_reduce(group, s, "max" if c.block_score == "max" else "sum")
        mass = mass_h.mean(2)  # [B, H, NB]
        nb = mass.shape[-1]
        sink_end = (torch.clamp(kv.seq_lens, max=c.n_sink) + s - 1) // s
        j = torch.arange(nb, device=mass.device).view(1, -1)
        sink_b = (j < sink_end.view(-1, 1)).unsqueeze(1)  # [B, 1, NB]
        exists = (j < self.num_blocks(kv).view(-1, 1)).unsqueeze(1)
        eligible = (exists & ~sink_b & ~bad.unsqueeze(-1)).expand_as(mass)
        kept_h = (mass_h * sink_b.unsqueeze(2)).sum(-1)  # [B, H, g]
        cap = self.anchor_width()
        order = torch.sort(mass.masked_fill(~eligible, -1.0), dim=-1, descending=True, stable=True)
        ranked = torch.gather(mass_h, -1, order.indices.unsqueeze(2).expand(b, h, g, nb))
        ok = torch.gather(eligible, -1, order.indices).unsqueeze(2)
        dropped_after = 1.0 - kept_h.unsqueeze(-1) - torch.cumsum(ranked * ok, dim=-1)
        need = 1 + (dropped_after > c.retrieval_target).sum(-1)  # [B, H, g]
        cnt = torch.minimum(need.amax(-1), eligible.sum(-1)).clamp(max=min(cap, nb))
        top = (
            order.indices[..., :cap]
            if nb >= cap
            else torch.nn.functional.pad(order.indices, (0, cap - nb), value=-1)
        )
        keep = torch.arange(cap, device=mass.device) < cnt.unsqueeze(-1)
        idx = torch.where(keep, top, -1).to(torch.int32)
        # Reorder the set by block score, so that dilation takes its first m entries.
        sc = torch.gather(block_scores, -1, idx.long().clamp(min=0))
        sc = sc.masked_fill(idx < 0, NEG_INF)
        order2, _ = topk_indices(sc.float(), idx.shape[-1], idx >= 0)
        idx = torch.gather(idx, -1, order2.long().clamp(min=0)).masked_fill(order2 < 0, -1)
        return idx, cnt.to(torch.int32)


def random_blocks(
    seq_lens: torch.Tensor,
    n_blocks: torch.Tensor,
    slots: torch.Tensor,
    layer: int,
    num_heads: int,
    count: int,
) -> torch.Tensor:
    """``[B, H, count]`` int64 block ids drawn uniformly from ``[0, n_blocks[b])``: a hash of
    (length, layer, state slot, head, entry), so a draw needs no generator state
    (graph-capturable, the same on every device), changes with every step and does not depend
    on where a request sits in the batch. RandomExpansion's positions."""
    p = 2147483647  # 2^31 - 1: MINSTD's modulus; every product below stays under 2^63
    dev = n_blocks.device
    t = seq_lens.long().view(-1, 1, 1)
    b = slots.long().view(-1, 1, 1)
    h = torch.arange(num_heads, device=dev).view(1, -1, 1)
    j = torch.arange(count, device=dev).view(1, 1, -1)
    x = (t * 1000003 + b * 7919 + h * 104729 + j * 15485863 + layer * 2654435 + 1) % p
    for _ in range(3):
        x = (x * 48271) % p
        x = x ^ (x >> 13)
    return x % torch.clamp(n_blocks.long().view(-1, 1, 1), min=1)


def _head_log_dropped_mass(logits: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``[B, H, g]`` float64 ``log δ`` of each query head; ``logits [B, H, g, T]`` (``-inf``
    past the end), ``keep [B, H, T]``."""
    lg = logits.double()
    lse_all = torch.logsumexp(lg, dim=-1)
    return torch.logsumexp(lg.masked_fill(keep.unsqueeze(2), NEG_INF), dim=-1) - lse_all
