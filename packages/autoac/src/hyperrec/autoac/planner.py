"""Choose, for every op output of every region, keep / pack / recompute under a budget.

:func:`plan` turns a :class:`~hyperrec.autoac.profiler.Profile` into a :class:`Plan`
whose predicted **peak** (the largest live bytes at any position of the step: forward,
every recomputation, every backward position) stays within ``budget``, with the least
added time. See :mod:`hyperrec.autoac.model` for the memory model and
:mod:`hyperrec.autoac.solve` for the solvers and their guarantees.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np

from hyperrec.autoac._exec import INPUT, RegionDecisions
from hyperrec.autoac._validate import (
    check_bool,
    check_choice,
    check_float,
    check_fraction,
    check_int,
)
from hyperrec.autoac.formats import SAVE_FORMATS
from hyperrec.autoac.model import (
    Assignment,
    Problem,
    build_problem,
    chosen,
    compress,
    held_of,
    least_peak,
    min_memory,
    peak_of,
    profile_of,
    time_of,
)
from hyperrec.autoac.profiler import Profile, RegionProfile
from hyperrec.autoac.solve import lagrangian_bound, solve_exact, solve_greedy

__all__ = [
    "MODES",
    "PRICINGS",
    "Plan",
    "PlanConfig",
    "RegionPlan",
    "partitioner_plan",
    "plan",
    "price_compiled_saves",
]

#: Values of :attr:`Plan.pricing`.
PRICINGS: tuple[str, ...] = ("profile", "compiled")
#: Values of :attr:`RegionPlan.mode`.
MODES: tuple[str, ...] = ("sac", "none", "partitioner")

Solver = Literal["auto", "exact", "greedy"]
Strategy = Literal["fastest", "pack_all"]
#: Values of :attr:`PlanConfig.strategy`.
STRATEGIES: tuple[str, ...] = ("fastest", "pack_all")


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """How :func:`plan` searches.

    Raises:
        TypeError: a field of the wrong type (``formats`` not a tuple or None, a float
            ``node_limit``).
        ValueError: a field out of range, an unknown ``solver`` or format.
    """

    solver: Solver = "auto"
    """``"exact"`` (branch and bound; proved optimal if it ends within ``node_limit``),
    ``"greedy"`` (marginal return, with a Lagrangian lower bound), or ``"auto"``: exact
    when there are at most ``exact_max_groups`` decisions, else greedy."""

    formats: tuple[str, ...] | None = None
    """Packed formats the plan may use (a subset of those the profile allowed);
    ``None``: all the profile allowed; ``()``: keep / recompute only."""

    allow_none: bool = True
    """Allow leaving a region un-checkpointed (its saved tensors kept or packed)."""

    exact_max_groups: int = 24
    """``"auto"`` uses the exact solver up to this many decisions."""

    node_limit: int = 200_000
    """Search nodes of the exact solver before it returns its best plan unproven."""

    bound_iters: int = 100
    """Subgradient iterations of the lower bound (0: skip the bound)."""

    strategy: Strategy = "fastest"
    """``"fastest"``: the plan that adds the least time within the budgets (the search
    above). ``"pack_all"``: no search: no region checkpointed (where the region allows
    it), every saved tensor kept in the first of ``formats`` (or of the profile's
    formats) its class passed, and kept as is where none did: the most a packed format
    alone cuts, at no recomputation. A region that must stay checkpointed
    (``allow_none=False``) recomputes the saves it cannot pack. The budgets are optional
    then; one given is checked against the plan's predicted peak (a ``ValueError``
    naming that peak if it does not fit; the plan may peak below the floor of full
    recompute, which does not pack)."""

    pack_inputs: bool = True
    """Allow an un-checkpointed region to pack the inputs its ops save (0.1.18), where
    the profile offers them (``SavedOp.is_input``: the profiled trace shows no other
    holder). ``False``: a region's inputs are kept as given, as before 0.1.18."""

    def __post_init__(self) -> None:
        check_choice("solver", self.solver, ("auto", "exact", "greedy"))
        check_choice("strategy", self.strategy, STRATEGIES)
        if self.formats is not None:
            if not isinstance(self.formats, tuple):
                raise TypeError(
                    f"formats must be a tuple or None, got {type(self.formats).__name__}"
                )
            for f in self.formats:
                check_choice("formats entry", f, SAVE_FORMATS)
        check_bool("allow_none", self.allow_none)
        check_bool("pack_inputs", self.pack_inputs)
        check_int("exact_max_groups", self.exact_max_groups, minimum=0)
        check_int("node_limit", self.node_limit, minimum=1)
        check_int("bound_iters", self.bound_iters, minimum=0)


@dataclass(frozen=True)
class RegionPlan:
    """The plan of one region.

    Attributes:
        name: region name.
        mode: ``"sac"``, ``"none"`` or ``"partitioner"`` (compiled with AOTAutograd's
            partitioner at ``activation_memory_budget = fraction``, autoac deciding
            nothing inside; see :func:`partitioner_plan`).
        saves: ``(op name, occurrence) -> "keep" | format`` for ops off the mode's
            default (``"sac"``: recompute; ``"none"``: keep; ``"partitioner"``: none).
        held_bytes: predicted bytes the region holds between its forward and its
            backward (inputs included).
        added_s: predicted seconds the region adds (recomputation, packing).
        recompute_s: seconds a full checkpoint of the region would add.
        input_bytes: bytes of its inputs (what a full checkpoint holds).
        noac_held_bytes: bytes it would hold un-checkpointed with nothing packed.
        fraction: a ``"partitioner"`` region's budget fraction, else ``None``.
    """

    name: str
    mode: str
    saves: dict[tuple[str, int], str]
    held_bytes: int
    added_s: float
    recompute_s: float
    input_bytes: int = 0
    noac_held_bytes: int = 0
    fraction: float | None = None

    @property
    def saved_fraction(self) -> float:
        """Held bytes beyond the inputs as a fraction of the un-checkpointed region's
        (the scale of torch's ``activation_memory_budget``), in [0, 1]."""
        den = self.noac_held_bytes - self.input_bytes
        if den <= 0:
            return 1.0
        return min(max((self.held_bytes - self.input_bytes) / den, 0.0), 1.0)


@dataclass(frozen=True)
class Plan:
    """What autoac does in every region, and what it predicts.

    Attributes:
        regions: per region.
        budget: the peak budget asked for (bytes), or ``None``.
        region_budgets: per-region held-bytes budgets asked for.
        predicted_peak: predicted peak of the step (bytes; on CUDA at the allocator's
            level, see :attr:`Profile.device_offset`).
        added_s: predicted seconds added to the step (vs. no checkpointing).
        lower_bound_s: a proven lower bound on the least added time any plan within the
            budgets can have (``-inf`` if not computed).
        proven_optimal: the exact solver proved this plan optimal (for the model).
        solver: the solver that produced it.
        floor: peak of full recompute, the least any plan predicts.
        no_ac_peak: predicted peak with no region checkpointed and nothing packed.
        full_recompute_s: added seconds of full recompute.
        min_pack_bytes: smallest storage that is packed.
        device: device of the profiled step.
        live: predicted live bytes at every position of the profiled trace (int64;
            device offset included), ``None`` after :meth:`from_dict`.
        pricing: where the regions' held bytes come from: ``"profile"`` (the profiled
            eager step, as :func:`plan` prices them) or ``"compiled"`` (what each
            compiled region's graph saved, see :func:`price_compiled_saves`).
    """

    regions: tuple[RegionPlan, ...]
    budget: int | None
    region_budgets: dict[str, int]
    predicted_peak: int
    added_s: float
    lower_bound_s: float
    proven_optimal: bool
    solver: str
    floor: int
    no_ac_peak: int
    full_recompute_s: float
    min_pack_bytes: int
    device: str
    live: np.ndarray | None = field(default=None, repr=False, compare=False)
    pricing: str = "profile"

    @property
    def gap_s(self) -> float:
        """``added_s - lower_bound_s``: how far from optimal the plan can be, at most."""
        return max(self.added_s - self.lower_bound_s, 0.0)

    @property
    def packed(self) -> bool:
        """Whether any saved tensor is packed."""
        return any(d in SAVE_FORMATS for r in self.regions for d in r.saves.values())

    def decisions(self) -> dict[str, RegionDecisions]:
        """Per region name, the decisions :func:`hyperrec.autoac.apply_plan` runs."""
        return {
            r.name: RegionDecisions(
                mode=r.mode,
                saves=dict(r.saves),
                min_pack_bytes=self.min_pack_bytes,
                fraction=r.fraction,
            )
            for r in self.regions
        }

    def summary(self) -> str:
        """A human-readable table of the plan."""
        gib = 2.0**30
        lines = [
            f"autoac plan ({self.solver}{', optimal' if self.proven_optimal else ''}): "
            f"peak {self.predicted_peak / gib:.3f} GiB"
            + (f" of budget {self.budget / gib:.3f} GiB" if self.budget is not None else "")
            + f"; floor {self.floor / gib:.3f}, no AC {self.no_ac_peak / gib:.3f} GiB; "
            # a partitioner plan's added time is the partitioner's: measured, not predicted
            + (
                "added time not predicted"
                if self.solver == "partitioner"
                else f"+{self.added_s * 1e3:.3f} ms"
            )  # fmt: skip
            + f" (full recompute +{self.full_recompute_s * 1e3:.3f} ms"
            + (
                f", lower bound {self.lower_bound_s * 1e3:.3f} ms"
                if math.isfinite(self.lower_bound_s)
                else ""
            )
            + ")",
            f"{'region':<24} {'mode':<5} {'kept':>5} {'packed':>6} {'held MiB':>9} {'+ms':>8}",
        ]
        for r in self.regions:
            kept = sum(1 for d in r.saves.values() if d == "keep")
            packed = sum(1 for d in r.saves.values() if d in SAVE_FORMATS)
            mode = r.mode if r.fraction is None else f"p{r.fraction:.2f}"
            lines.append(
                f"{r.name:<24} {mode:<5} {kept:>5} {packed:>6} "
                f"{r.held_bytes / 2**20:>9.2f} {r.added_s * 1e3:>8.3f}"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable form (round-trips through :meth:`from_dict`)."""
        return {
            "version": 1,
            "regions": [
                {
                    "name": r.name,
                    "mode": r.mode,
                    "saves": [[k[0], k[1], d] for k, d in sorted(r.saves.items())],
                    "held_bytes": r.held_bytes,
                    "added_s": r.added_s,
                    "recompute_s": r.recompute_s,
                    "input_bytes": r.input_bytes,
                    "noac_held_bytes": r.noac_held_bytes,
                    **({} if r.fraction is None else {"fraction": r.fraction}),
                }
                for r in self.regions
            ],
            "budget": self.budget,
            "region_budgets": dict(self.region_budgets),
            "predicted_peak": self.predicted_peak,
            "added_s": self.added_s,
            "lower_bound_s": self.lower_bound_s if math.isfinite(self.lower_bound_s) else None,
            "proven_optimal": self.proven_optimal,
            "solver": self.solver,
            "floor": self.floor,
            "no_ac_peak": self.no_ac_peak,
            "full_recompute_s": self.full_recompute_s,
            "min_pack_bytes": self.min_pack_bytes,
            "device": self.device,
            "pricing": self.pricing,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Plan:
        """Rebuild a plan saved with :meth:`to_dict`.

        Raises:
            TypeError: ``d`` is not a mapping, or a field of the wrong type.
            ValueError: missing fields, an unknown version, mode or decision, a field of
                the wrong value.
        """
        if not isinstance(d, Mapping):
            raise TypeError(f"d must be a mapping, got {type(d).__name__}")
        if d.get("version") != 1:
            raise ValueError(f"d must be a version-1 plan, got version {d.get('version')!r}")

        # Every field is checked, not cast: a hand-edited or corrupted plan file must not
        # load as a different plan (``int(2.7)``, ``bool("no")``).
        def text(name: str, v: Any) -> str:
            if not isinstance(v, str):
                raise TypeError(f"{name} must be a str, got {type(v).__name__} {v!r}")
            return v

        def nbytes(name: str, v: Any) -> int:
            return check_int(name, v, minimum=0)

        def items(name: str, v: Any) -> list[Any] | tuple[Any, ...]:
            if not isinstance(v, list | tuple):
                raise TypeError(f"{name} must be a list, got {type(v).__name__} {v!r}")
            return v

        try:
            regions = []
            for r in items("regions", d["regions"]):
                check_choice("mode", r["mode"], MODES)
                saves = {}
                for op, occ, dec in items("saves", r["saves"]):
                    check_choice("decision", dec, ("keep", *SAVE_FORMATS))
                    saves[(text("op", op), check_int("occurrence", occ, minimum=0))] = dec
                fraction = r.get("fraction")
                if (fraction is None) != (r["mode"] != "partitioner"):
                    raise ValueError(
                        "a region has a fraction if and only if its mode is 'partitioner', "
                        f"got mode {r['mode']!r} with fraction {fraction!r}"
                    )
                if fraction is not None:
                    fraction = check_fraction("fraction", fraction)
                    if saves:
                        raise ValueError("a 'partitioner' region has no saves, got some")
                regions.append(
                    RegionPlan(
                        text("name", r["name"]),
                        r["mode"],
                        saves,
                        nbytes("held_bytes", r["held_bytes"]),
                        check_float("added_s", r["added_s"]),
                        check_float("recompute_s", r["recompute_s"]),
                        nbytes("input_bytes", r.get("input_bytes", 0)),
                        nbytes("noac_held_bytes", r.get("noac_held_bytes", 0)),
                        fraction,
                    )
                )
            lb = d["lower_bound_s"]
            return cls(
                regions=tuple(regions),
                budget=None if d["budget"] is None else nbytes("budget", d["budget"]),
                region_budgets={
                    text("region_budgets key", k): nbytes(f"region_budgets[{k!r}]", v)
                    for k, v in d["region_budgets"].items()
                },
                predicted_peak=nbytes("predicted_peak", d["predicted_peak"]),
                added_s=check_float("added_s", d["added_s"]),
                lower_bound_s=-math.inf if lb is None else check_float("lower_bound_s", lb),
                proven_optimal=check_bool("proven_optimal", d["proven_optimal"]),
                solver=text("solver", d["solver"]),
                floor=nbytes("floor", d["floor"]),
                no_ac_peak=nbytes("no_ac_peak", d["no_ac_peak"]),
                full_recompute_s=check_float("full_recompute_s", d["full_recompute_s"]),
                min_pack_bytes=nbytes("min_pack_bytes", d["min_pack_bytes"]),
                device=text("device", d["device"]),
                pricing=check_choice("pricing", d.get("pricing", "profile"), PRICINGS),
            )
        except KeyError as exc:
            raise ValueError(f"d is missing the plan field {exc.args[0]!r}") from None
        except (TypeError, ValueError, AttributeError) as exc:
            # A field of the wrong type or value (``int("abc")``, ``None`` regions, ...).
            kind = ValueError if isinstance(exc, ValueError) else TypeError
            raise kind(f"d is not a plan from Plan.to_dict: {exc}") from None


# --------------------------------------------------------------------------- planning
#: Caps the solvers see are clamped here (the solvers add and compare bytes in int64);
#: a larger budget constrains nothing, and the plan still records the one asked for.
_CAP_MAX = 2**62


def measured_formats(
    profile: Profile, formats: tuple[str, ...] | None, name: str
) -> tuple[str, ...]:
    """``formats`` (``None``: every format the profile measured), which must be among
    those the profile measured: it has no error or cost for the others, and a plan
    would silently skip them.

    Raises:
        ValueError: a format the profile did not measure (the message names ``name``).
    """
    measured = tuple(profile.config.formats)
    out = measured if formats is None else tuple(formats)
    if not set(out) <= set(measured):
        raise ValueError(
            f"{name} must be a subset of the formats the profile measured {measured}, got {out}"
        )
    return out


def _bytes(name: str, value: Any, floor: int, what: str) -> int:
    """A budget in bytes, or a ValueError that names the smallest feasible one."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of bytes, got {type(value).__name__} {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < floor:
        raise ValueError(
            f"{name} must be a finite number of bytes >= {floor} "
            f"({floor / 2**30:.4f} GiB, {what}), got {value!r}"
        )
    return int(v)


def _no_ac(prob: Problem) -> Assignment:
    """No region checkpointed where it may stay un-checkpointed, nothing packed."""
    return _pack_all(prob, ())


def _pack_all(prob: Problem, formats: tuple[str, ...]) -> Assignment:
    """No region checkpointed where it may stay un-checkpointed; every group in the
    first of ``formats`` it offers, else kept (recomputed in a region that must be
    checkpointed)."""
    modes = tuple("none" if "none" in r.fixed_s else "sac" for r in prob.regions)
    picks = []
    for g in prob.groups:
        opts = g.choices[modes[g.region]]
        kinds = [c.kind for c in opts]
        pick = next((kinds.index(f) for f in formats if f in kinds), None)
        if pick is None:
            none = modes[g.region] == "none"
            pick = next(i for i, k in enumerate(kinds) if k in ("keep", "drop")) if none else 0
        picks.append(pick)
    return Assignment(modes, tuple(picks))


def plan(
    profile: Profile,
    *,
    budget: float | None = None,
    region_budgets: Mapping[str, float] | None = None,
    config: PlanConfig | None = None,
) -> Plan:
    """The fastest plan whose predicted peak is within ``budget``.

    Args:
        profile: from :func:`hyperrec.autoac.profiler`.
        budget: peak memory of the step in bytes (on CUDA: as
            ``torch.cuda.max_memory_allocated`` counts it; on the CPU: live tensor
            storages, see :class:`~hyperrec.autoac.tracker.MemoryTracker`).
        region_budgets: ``region name -> bytes`` the region may hold between its forward
            and its backward (its inputs included): GEM-style per-region budgets. Both
            may be given.
        config: :class:`PlanConfig`.

    Returns:
        :class:`Plan`. With ``config.strategy="pack_all"`` no search runs: the plan packs
        every saved tensor it can (see :class:`PlanConfig`), ``solver`` is
        ``"pack_all"``.

    Raises:
        TypeError: a budget that is not a number; bad ``config``/``profile`` types.
        ValueError: neither budget given (except with ``"pack_all"``); a budget that is
            negative, NaN, infinite or below the floor of full recompute (the message
            names the smallest feasible budget); an unknown region name;
            ``config.formats`` beyond the formats the profile measured; with
            ``"pack_all"``, no format to pack in, or a budget below the packed plan's
            predicted peak or held bytes (the message names them).
    """
    if not isinstance(profile, Profile):
        raise TypeError(f"profile must be a Profile, got {type(profile).__name__}")
    config = PlanConfig() if config is None else config
    if not isinstance(config, PlanConfig):
        raise TypeError(f"config must be a PlanConfig, got {type(config).__name__}")
    pack_all = config.strategy == "pack_all"
    if budget is None and not region_budgets and not pack_all:
        raise ValueError("budget or region_budgets must be given, got neither")
    formats = measured_formats(profile, config.formats, "config.formats")
    if not config.pack_inputs:
        profile = restrict(profile, {(INPUT, f) for f in SAVE_FORMATS})
    if pack_all and not formats:
        raise ValueError(
            "config.strategy='pack_all' needs a packed format: give config.formats or "
            "profile with ProfileConfig.formats (or apply(formats=...))"
        )
    raw = build_problem(profile, formats=tuple(formats), allow_none=config.allow_none)
    prob = compress(raw)
    offset = profile.device_offset
    # The floor: full recompute, except regions whose checkpoint raises the peak (it
    # holds their inputs and re-allocates what the backward does not need), which
    # stay un-checkpointed (see least_peak). A region with a budget of its own is
    # floored at a full checkpoint's held bytes, and left un-checkpointed in the step's
    # floor only where that fits its budget.
    rb_names = set(region_budgets) if isinstance(region_budgets, Mapping) else set()
    frozen = frozenset(i for i, r in enumerate(prob.regions) if r.name in rb_names)
    full_a = min_memory(prob)
    caps: dict[int, int] = {}
    rb_out: dict[str, int] = {}
    if region_budgets:
        if not isinstance(region_budgets, Mapping):
            raise TypeError(
                f"region_budgets must be a mapping of region name to bytes, got "
                f"{type(region_budgets).__name__}"
            )
        names = {r.name: i for i, r in enumerate(prob.regions)}
        for name, b in region_budgets.items():
            if name not in names:
                raise ValueError(
                    f"region_budgets has an unknown region {name!r}; regions: {sorted(names)}"
                )
            r = names[name]
            rp = profile.regions[r]
            # a region's held bytes depend on its own decisions only: min_memory's are
            # its least
            floor_r = prob.regions[r].input_bytes + held_of(prob, full_a, r) + rp.plain_held_bytes
            v = _bytes(
                f"region_budgets[{name!r}]",
                b,
                floor_r,
                "what it holds un-checkpointed: autoac cannot checkpoint it (it runs an "
                "in-place collective, draws from an explicit generator or writes into its "
                "input)"
                if rp.modes == ("none",)
                else "its inputs, held by a full checkpoint",
            )
            caps[r] = min(v - prob.regions[r].input_bytes, _CAP_MAX)
            rb_out[name] = v
    floor_a = least_peak(prob, frozen=frozen, caps=caps)
    floor = peak_of(prob, floor_a) + offset
    cap = None
    if budget is not None:
        # pack_all is checked against its own peak (_check_pack_all), which can be below
        # the floor: least_peak does not try packed saves
        cap = _bytes(
            "budget",
            budget,
            0 if pack_all else floor,
            "a number of bytes"
            if pack_all
            else "the peak of full recompute with the regions whose checkpoint raises the "
            "peak left un-checkpointed, the least this step can use",
        )
    prob.cap = None if cap is None else min(cap - offset, _CAP_MAX)
    prob.region_caps = caps
    raw.cap, raw.region_caps = prob.cap, caps

    lb = -math.inf
    if pack_all:
        a = _pack_all(prob, tuple(formats))
        t = time_of(prob, a)
        proven, solver = False, "pack_all"
        _check_pack_all(prob, a, cap, caps, offset)
    else:
        g = solve_greedy(prob, start=floor_a)
        result = g
        solver = "greedy"
        use_exact = config.solver == "exact" or (
            config.solver == "auto" and len(prob.groups) <= config.exact_max_groups
        )
        if use_exact:
            result = solve_exact(prob, node_limit=config.node_limit, incumbent=g.assignment)
            solver = "exact"
        a = result.assignment
        t = time_of(prob, a)
        proven = result.proven_optimal
        if proven:
            lb = t
        elif config.bound_iters:
            lb = float(min(lagrangian_bound(prob, iters=config.bound_iters, upper=t), t))
    live = profile_of(raw, a) + offset
    # No AC is measured on the problem that has every region's "none" mode: with
    # allow_none=False ``prob`` has none, and _no_ac(prob) was full recompute, so
    # no_ac_peak reported the floor and every region's noac_held_bytes its inputs
    # (saved_fraction 1.0 for a fully recomputed region: the "memory_budget" compile
    # fallback then kept everything).
    noac_prob = prob if config.allow_none else compress(build_problem(profile, formats=()))
    no_ac = _no_ac(noac_prob)
    full_t = time_of(prob, full_a)
    region_plans = []
    for r, reg in enumerate(prob.regions):
        mode = a.modes[r]
        saves: dict[tuple[str, int], str] = {}
        added = reg.fixed_s[mode]
        for gi in reg.groups:
            c = chosen(prob, a, gi)
            added += c.time_s
            if c.kind in ("recompute", "drop") or (mode == "none" and c.kind == "keep"):
                continue
            op = prob.groups[gi].op
            if op is None:
                # build_problem gives every group a plan can decide for its op (the
                # backward fit's groups have none, and only "drop" options); only
                # hand-built problems lack one.
                raise RuntimeError(f"group {gi} of the planning problem has no op")
            saves[op.key] = c.kind
        rp = profile.regions[r]
        region_plans.append(
            RegionPlan(
                name=reg.name,
                mode=mode,
                saves=saves,
                held_bytes=reg.input_bytes + held_of(prob, a, r) + rp.plain_held_bytes,
                added_s=added,
                recompute_s=rp.full_recompute_s,
                input_bytes=reg.input_bytes,
                noac_held_bytes=reg.input_bytes
                + held_of(noac_prob, no_ac, r)
                + rp.plain_held_bytes,
            )
        )
    best = Plan(
        regions=tuple(region_plans),
        budget=cap,
        region_budgets=rb_out,
        predicted_peak=int(live.max(initial=0)),
        added_s=t,
        lower_bound_s=lb,
        proven_optimal=proven,
        solver=solver,
        floor=floor,
        no_ac_peak=peak_of(noac_prob, no_ac) + offset,
        full_recompute_s=full_t,
        min_pack_bytes=profile.config.min_pack_bytes,
        device=profile.device,
        live=live,
    )
    if not formats or pack_all:
        return best
    # Packed formats only add choices, but the greedy's path depends on them: on the
    # H200 (2026-12-03) a plan allowed MXFP8 chose no packed save and a different
    # keep/recompute split than the plan without formats, predicted 0.35 ms slower and
    # measured 6.6% slower. So the keep/recompute-only plan is computed too and wins
    # ties (no quantization error for the same predicted time).
    plain = plan(
        profile, budget=budget, region_budgets=region_budgets, config=replace(config, formats=())
    )
    if plain.added_s > best.added_s:
        return best
    # ``best``'s bound covers every plan with or without packed saves; ``plain``'s only
    # those without. If ``best`` was proven optimal, ``plain`` ties it and is too.
    return replace(
        plain,
        lower_bound_s=min(best.lower_bound_s, plain.lower_bound_s),
        proven_optimal=best.proven_optimal,
    )


def partitioner_plan(
    profile: Profile, fraction: float | Mapping[str, float], *, budget: float | None = None
) -> Plan:
    """The plan that leaves every region's choice to AOTAutograd's partitioner at
    ``activation_memory_budget = fraction`` (torch's own knob, per region), for compiled
    regions only.

    Regions that may be checkpointed get mode ``"partitioner"`` (with a mapping: those
    it names); the others (a collective, an explicit generator, an in-place write into
    an input: see :class:`~hyperrec.autoac.profiler.RegionProfile`; with a mapping, also
    the regions it leaves out) stay ``"none"`` and compile with the default partition,
    as in every plan. Its prediction is un-checkpointed regions
    holding everything (nothing packed); :func:`hyperrec.autoac.price_compiled` prices
    what the partitioner's graphs save. What the partitioner recomputes is not
    predicted: ``added_s`` is 0.0 and ``solver`` ``"partitioner"``; only a measured step
    says its time (:func:`hyperrec.autoac.apply` with ``partitioner_fractions`` measures
    it against autoac's own plan).

    Args:
        profile: from :func:`hyperrec.autoac.profiler`.
        fraction: the partitioner's ``activation_memory_budget``, in [0, 1] (1: the
            default partition, 0: recompute all it can), for every region, or
            ``region name -> fraction``.
        budget: recorded as :attr:`Plan.budget` (not enforced: the plan is fixed).

    Raises:
        TypeError: ``profile`` not a :class:`Profile`; ``fraction`` or ``budget`` not a
            number (or a mapping of numbers).
        ValueError: a fraction outside [0, 1]; a mapping naming a region the profile
            does not have, or one that cannot be handed to the partitioner; a negative
            or non-finite ``budget``.
    """
    if not isinstance(profile, Profile):
        raise TypeError(f"profile must be a Profile, got {type(profile).__name__}")
    eligible = {
        r.name for r in profile.regions if "sac" in r.modes and not any(o.collective for o in r.ops)
    }
    if isinstance(fraction, Mapping):
        names = {r.name for r in profile.regions}
        unknown = sorted(set(fraction) - names)
        if unknown:
            raise ValueError(f"fraction names regions {unknown} that the profile does not have")
        fixed = sorted(set(fraction) - eligible)
        if fixed:
            raise ValueError(
                f"fraction names regions {fixed} that stay un-checkpointed (a collective, "
                "an explicit generator or an in-place write into an input): the "
                "partitioner may not recompute in them"
            )
        fractions = {n: check_fraction(f"fraction[{n!r}]", f) for n, f in fraction.items()}
    else:
        f = check_fraction("fraction", fraction)
        fractions = dict.fromkeys(eligible, f)
    cap = None if budget is None else _bytes("budget", budget, 0, "a number of bytes")
    raw = build_problem(profile, formats=())
    prob = compress(raw)
    a = _no_ac(prob)
    live = profile_of(raw, a) + profile.device_offset
    regions = []
    for r, reg in enumerate(prob.regions):
        rp = profile.regions[r]
        frac = fractions.get(reg.name)
        held = reg.input_bytes + held_of(prob, a, r) + rp.plain_held_bytes
        regions.append(
            RegionPlan(
                name=reg.name,
                mode="none" if frac is None else "partitioner",
                saves={},
                held_bytes=held,
                added_s=0.0,
                recompute_s=rp.full_recompute_s,
                input_bytes=reg.input_bytes,
                noac_held_bytes=held,
                fraction=frac,
            )
        )
    peak = int(live.max(initial=0))
    floor = peak_of(prob, least_peak(prob)) + profile.device_offset
    return Plan(
        regions=tuple(regions),
        budget=cap,
        region_budgets={},
        predicted_peak=peak,
        added_s=0.0,
        lower_bound_s=-math.inf,
        proven_optimal=False,
        solver="partitioner",
        floor=floor,
        no_ac_peak=peak,
        full_recompute_s=time_of(prob, min_memory(prob)),
        min_pack_bytes=profile.config.min_pack_bytes,
        device=profile.device,
        live=live,
    )


def _check_pack_all(
    prob: Problem, a: Assignment, cap: int | None, caps: dict[int, int], offset: int
) -> None:
    """A ``"pack_all"`` plan is not searched: a budget it does not fit is an error, not
    a plan over its budget."""
    if cap is not None:
        peak = peak_of(prob, a) + offset
        if peak > cap:
            raise ValueError(
                f"budget must be >= {peak} ({peak / 2**30:.4f} GiB), the predicted peak of "
                f"config.strategy='pack_all', got {cap}"
            )
    for r, c in caps.items():
        held = held_of(prob, a, r)
        if held > c:
            name = prob.regions[r].name
            need = held + prob.regions[r].input_bytes
            raise ValueError(
                f"region_budgets[{name!r}] must be >= {need} ({need / 2**30:.4f} GiB), what "
                f"the region holds under config.strategy='pack_all', got "
                f"{c + prob.regions[r].input_bytes}"
            )


def restrict(profile: Profile, exclude: set[tuple[str, str]]) -> Profile:
    """``profile`` with the ``(op class, format)`` pairs in ``exclude`` disallowed."""
    regions = tuple(
        replace(
            r,
            ops=tuple(
                replace(o, formats=tuple(f for f in o.formats if (o.op_class, f) not in exclude))
                for o in r.ops
            ),
        )
        for r in profile.regions
    )
    return replace(profile, regions=regions)


def _held_span(r: RegionProfile) -> tuple[int, int] | None:
    """Positions of the profiled trace over which region ``r`` holds its saves: from its
    forward's last allocation to the start of its recomputation (where its backward
    begins); ``None`` for a region profiled un-checkpointed (no recomputation)."""
    if r.rc_start is None:
        return None
    allocs = [lv.fwd_alloc for o in r.ops for lv in o.storages]
    start = max(allocs) + 1 if allocs else r.fwd_start
    return min(start, r.rc_start), r.rc_start


def check_saves_args(plan_: Any, profile: Any, saved: Any, profile_arg: str) -> None:
    """The type checks of :func:`price_compiled_saves` and ``calibrate_none`` (the
    profile's argument named ``profile_arg``)."""
    if not isinstance(plan_, Plan):
        raise TypeError(f"plan_ must be a Plan, got {type(plan_).__name__}")
    if not isinstance(profile, Profile):
        raise TypeError(f"{profile_arg} must be a Profile, got {type(profile).__name__}")
    if not isinstance(saved, Mapping):
        raise TypeError(f"saved must be a mapping of region name to bytes, got {saved!r}")


def price_compiled_saves(plan_: Plan, profile: Profile, saved: Mapping[str, int]) -> Plan:
    """``plan_`` with the held bytes of the regions in ``saved`` priced from their
    compiled graphs.

    :func:`plan` prices each region from the profiled eager step. A compiled region
    holds, from its forward to its backward, what its graph saves (AOTAutograd's
    partitioner chooses; packing hooks pack whole op classes), which can be more or less.
    For each region named in ``saved`` the difference between those bytes and the
    plan's (beyond the region's inputs) is added to the predicted live bytes from the
    end of the region's forward to the start of its backward; ``predicted_peak`` is the
    maximum of the result and ``held_bytes`` the region's inputs plus ``saved[name]``.
    Everything else (the decisions, times, floor, other regions) stays as planned.

    Args:
        plan_: a plan made by :func:`plan` from ``profile`` (with :attr:`Plan.live`).
        profile: the profile it was made from.
        saved: region name -> bytes its compiled graph saves for the backward beyond
            its inputs and parameters (see
            :func:`hyperrec.autoac.price_compiled`). Regions left out, and regions
            profiled un-checkpointed, keep their planned bytes.

    Returns:
        A :class:`Plan` with ``pricing="compiled"``.

    Raises:
        TypeError: arguments of the wrong type; a byte count that is not an int.
        ValueError: a plan without ``live`` (loaded with :meth:`Plan.from_dict`) or of
            another length than the profile's trace, an unknown region name, a negative
            byte count.
    """
    check_saves_args(plan_, profile, saved, "profile")
    if plan_.live is None or len(plan_.live) != len(profile.live):
        raise ValueError(
            "plan_ must carry the live bytes of a plan made from profile (plan_.live), got "
            + ("None (a loaded plan)" if plan_.live is None else f"{len(plan_.live)} positions")
        )
    by_name = {r.name: (rp, r) for rp, r in zip(plan_.regions, profile.regions)}
    unknown = sorted(set(saved) - set(by_name))
    if unknown:
        raise ValueError(f"saved names regions {unknown} that plan_ does not have")
    live = np.array(plan_.live, dtype=np.int64)
    regions = []
    for rp in plan_.regions:
        if rp.name not in saved:
            regions.append(rp)
            continue
        held = check_int(f"saved[{rp.name!r}]", saved[rp.name], minimum=0)
        span = _held_span(by_name[rp.name][1])
        if span is None:
            regions.append(rp)
            continue
        a, b = span
        live[a:b] += held - (rp.held_bytes - rp.input_bytes)
        regions.append(replace(rp, held_bytes=rp.input_bytes + held))
    return replace(
        plan_,
        regions=tuple(regions),
        predicted_peak=int(live.max(initial=0)),
        live=live,
        pricing="compiled",
    )
