"""Per-layer INT8 health over a run (`--int8-stats-interval`) and automatic per-GEMM fallback
(`--int8-auto-fallback`).

`HealthMonitor` attaches a probe (ops.health.LinearProbe) to every INT8 linear of the model, arms them all
before each statistics step (every `interval` iterations) and, at the log line, reads every measurement of
the interval in one host sync. Values are the worst over tensor- and data-parallel ranks (MAX); under
pipeline parallelism every rank gathers the other stages' layers, so that all ranks see the same table
and take the same decisions.

`AutoFallback` watches each GEMM (fprop, dgrad, wgrad) of each linear: a GEMM whose sampled relative error
exceeds its `max_rel_err`, or whose operands' underflow exceeds `max_underflow`, on `patience` consecutive checks
moves to a safer mode: tensorwise scales become row scales (the recipe's granularity is the linear's, so all
three GEMMs of that linear get them), and with row (or block) scales that GEMM alone goes to high precision.
Block scales are not a step on this ladder: their 1 x 128 tiles are finer than row scales for activations
and gradients, but their 128 x 128 weight tiles are coarser than row scales' one scale per output channel,
and an outlier weight row (as the aligned SwiGLU rows of the stress test) then sets the scale of 127 other
rows (benchmarks/stress_outliers.py at tiny size, 2026-11-27: fc1 moved row -> block kept failing). Every move is logged with its reason, shown in the precision table,
written to checkpoints (`state_dict`) and restored on resume, also when the resumed run has auto fallback
off; only `--int8-reset-fallback` drops the moves.

INT8 attention (`--int8-attention`) is watched the same way, as one more unit of its layer named
'layer<n>.self_attention.core_attention' (`int8_attentions`): its probe (ops.health.AttentionProbe) samples the
output's error against fp32 attention, and an error over `max_attention_rel_err` on `patience` consecutive
checks moves that layer's attention to BF16 SDPA (its mode: {"int8_attention": False}), logged, checkpointed and
restored as a linear's moves are.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import torch

from ..ops.health import ATTENTION_STATS, STAT_NAMES, AttentionProbe, LinearProbe
from ..recipe import GEMMS, Int8Recipe
from .cpu import training_device

if TYPE_CHECKING:
    from ..megatron.attention import SDPAttention
    from ..megatron.layers import Int8LinearMixin

FINER_GRANULARITY = {"tensor": "row"}  # the one step that is finer for every operand (see the docstring)
MODE_FIELDS = ("granularity",) + GEMMS  # what a fallback changes in a linear's recipe
ATTENTION = "attention"  # the unit an INT8 attention is watched as (a linear's are its GEMMs)
ATTENTION_MODE_FIELDS = ("int8_attention",)  # what a fallback changes in an INT8 attention


@dataclasses.dataclass(frozen=True)
class FallbackThresholds:
    """When a GEMM falls back (docs/numerics.md explains the defaults).

    max_rel_err: the largest sampled relative error of fprop, dgrad and wgrad against their exact results
        (three values, or one value for all three). Row-scaled INT8 keeps fprop and dgrad near 1-2% (about crest / 440
        per operand); a few channels 100x above the rest push fc2's fprop past 20%. wgrad contracts over
        tokens whose output gradients are heavy-tailed per channel: a healthy run had a linear at 37%
        (configs/tiny.yaml, mock data, iteration 5, 2026-11-27, CPU), an unbiased error that training
        tolerates (docs/convergence.md's parity), so its limit is where the error is as large as the result.
    max_underflow: the largest fraction of an operand's nonzero elements that quantize to zero in a GEMM
        (three values, or one for all three). fprop and dgrad: the same healthy run had up to 0.36 (a dY per
        token). wgrad's operands are scaled per channel over all the tokens, and its underflow grows with
        training: 0.61 in the 88M parity run, 0.77 at the end of the 344M run of docs/convergence.md (section
        7), whose loss ended 0.22% from BF16's; its limit sits above that, and its rel_err limit guards it.
    patience: consecutive statistics checks over a threshold before the move (a single noisy step does
        not move a layer).
    max_attention_rel_err: the largest sampled relative error of an INT8 attention's output (attention/rel_err)
        against fp32 attention. INT8 attention's O sits near 27-30 dB SNR against float64 on activation-like
        data (0.03-0.045 relative; tests/kernels/test_int8_attention.py, and seq 4096 on an H200, 2026-12-02):
        0.1 (20 dB) is over twice that.
    """

    max_rel_err: Tuple[float, float, float] = (0.1, 0.1, 1.0)
    max_underflow: Tuple[float, float, float] = (0.7, 0.7, 0.9)
    patience: int = 3
    max_attention_rel_err: float = 0.1

    def __post_init__(self):
        object.__setattr__(self, "max_rel_err", per_gemm_limits("max_rel_err", self.max_rel_err, math.inf))
        object.__setattr__(self, "max_underflow", per_gemm_limits("max_underflow", self.max_underflow, 1.0))
        if not isinstance(self.patience, int) or self.patience < 1:
            raise ValueError(f"patience must be a positive int, got {self.patience!r}")
        if not (isinstance(self.max_attention_rel_err, (int, float)) and self.max_attention_rel_err > 0):
            raise ValueError(f"max_attention_rel_err must be positive, got {self.max_attention_rel_err!r}")

    def crossed(self, gemm: str, values: Dict[str, float]) -> List[str]:
        """The thresholds `gemm` (or ATTENTION) crosses in one check (`values`: stat name -> value; absent or NaN:
        not crossed), as reasons for the log."""
        err, under = values.get(f"{gemm}/rel_err", math.nan), values.get(f"{gemm}/underflow", math.nan)
        if gemm == ATTENTION:
            limit, under_limit = self.max_attention_rel_err, math.inf
        else:
            limit, under_limit = self.max_rel_err[GEMMS.index(gemm)], self.max_underflow[GEMMS.index(gemm)]
        reasons = [f"rel_err {err:.3g} > {limit:g}"] if err > limit else []
        if under > under_limit:
            reasons.append(f"underflow {under:.3g} > {under_limit:g}")
        return reasons


def per_gemm_limits(name: str, limits, largest: float) -> Tuple[float, ...]:
    """One limit per GEMM (fprop, dgrad, wgrad) from one value or three, each in (0, largest]; ValueError naming
    `name` (a field, or the command-line flag that gave them) otherwise."""
    values = tuple(float(v) for v in ((limits,) if isinstance(limits, (int, float)) else limits))
    values = values * len(GEMMS) if len(values) == 1 else values
    if len(values) != len(GEMMS) or not all(0 < v <= largest for v in values):
        bound = "positive" if largest == math.inf else f"in (0, {largest:g}]"
        raise ValueError(f"{name} takes one limit, or three ({' '.join(GEMMS)}), each {bound}, got {limits}")
    return values


def recipe_mode(recipe: Int8Recipe) -> dict:
    """The fields of a recipe that fallback changes."""
    return {name: getattr(recipe, name) for name in MODE_FIELDS}


def watched_units(mode: dict) -> Tuple[str, ...]:
    """What a check of a unit in `mode` looks at: a linear's three GEMMs, or ATTENTION."""
    return (ATTENTION,) if "int8_attention" in mode else GEMMS


def _runs_int8(mode: dict, unit: str) -> bool:
    return mode["int8_attention" if unit == ATTENTION else unit]


def safer_mode(mode: dict, gemm: str) -> Optional[Tuple[dict, str]]:
    """(the next safer mode for `gemm` (or ATTENTION), what changed), or None when it already runs in high
    precision."""
    if not _runs_int8(mode, gemm):
        return None
    if gemm == ATTENTION:
        return {**mode, "int8_attention": False}, "INT8 -> BF16 attention"
    finer = FINER_GRANULARITY.get(mode["granularity"])
    if finer is not None:
        return {**mode, "granularity": finer}, f"scales {mode['granularity']} -> {finer}"
    return {**mode, gemm: False}, f"{gemm} -> high precision"


class AutoFallback:
    """The fallback decisions and their state: each GEMM's streak of checks over a threshold, and the mode
    every moved linear runs in (with the events that moved it). Deterministic in the checks it is given, so
    every rank, given the same checks, holds the same state."""

    def __init__(self, thresholds: FallbackThresholds = FallbackThresholds(), enabled: bool = True):
        self.thresholds = thresholds
        self.enabled = enabled
        self.streaks: Dict[str, int] = {}
        self.moved: Dict[str, dict] = {}  # linear name -> {"mode": {...}, "events": [...]}

    def mode_of(self, name: str, built: dict) -> dict:
        """The mode linear `name` runs in: its fallback mode on the one it was built with (`on_built_mode`: a move
        a run of other settings saved) if it moved, else the built one."""
        if name not in self.moved:
            return dict(built)
        moved = self.moved[name]["mode"]
        return dict(moved) if "int8_attention" in moved else on_built_mode(built, moved)

    def check(self, iteration: int, name: str, built: dict, values: Dict[str, float]) -> List[dict]:
        """One statistics check of one linear or INT8 attention (`values`: stat name -> value, NaN or absent: not
        measured); returns the fallback events it causes (empty when auto fallback is off)."""
        if not self.enabled:
            return []
        events = []
        limits = self.thresholds
        for gemm in watched_units(built):
            mode = self.mode_of(name, built)
            if not _runs_int8(mode, gemm):
                continue  # already high precision: nothing to watch
            if all(math.isnan(values.get(f"{gemm}/{stat}", math.nan)) for stat in ("rel_err", "underflow")):
                continue  # not measured this time: the streak neither grows nor breaks
            reasons = limits.crossed(gemm, values)
            key = f"{name}/{gemm}"
            self.streaks[key] = self.streaks.get(key, 0) + 1 if reasons else 0
            if self.streaks[key] < limits.patience:
                continue
            new_mode, change = safer_mode(mode, gemm)
            event = {"iteration": iteration, "linear": name, "gemm": gemm, "change": change,
                     "reason": f"{' and '.join(reasons)} on {limits.patience} consecutive checks"}
            entry = self.moved.setdefault(name, {"mode": mode, "events": []})
            entry["mode"] = new_mode
            entry["events"].append(event)
            for g in watched_units(built):  # the unit runs differently now: its measurements start over
                self.streaks.pop(f"{name}/{g}", None)
            events.append(event)
            break  # this check measured the old mode: the linear's other GEMMs wait for the next one
        return events

    def state_dict(self) -> dict:
        return {"streaks": dict(self.streaks),
                "moved": {name: {"mode": dict(e["mode"]), "events": [dict(v) for v in e["events"]]}
                          for name, e in self.moved.items()}}

    def load_state_dict(self, state: Optional[dict]) -> None:
        state = state or {}
        self.streaks = dict(state.get("streaks", {}))
        self.moved = {name: {"mode": dict(e["mode"]), "events": list(e["events"])}
                      for name, e in state.get("moved", {}).items()}
        for name, entry in self.moved.items():
            fields = ATTENTION_MODE_FIELDS if "int8_attention" in entry["mode"] else MODE_FIELDS
            unknown = set(entry["mode"]) ^ set(fields)
            if unknown:
                raise ValueError(f"int8 fallback state of {name}: unexpected mode fields {sorted(unknown)}")

    def regroup_experts(self, experts: int, saved_ep: int, ep: int) -> List[str]:
        """Move the expert slots of a checkpoint saved under `saved_ep` expert-parallel ranks onto this run's `ep`.
        An expert linear is named by its local slot (`...local_experts.<i>...`), and slot i holds expert
        r * experts / ep + i on rank r: another expert at each size. A saved slot's move covers every expert it
        held, and a slot of this run moves where any expert it holds had moved (each GEMM INT8 only where every
        such move kept it, the finer scales where any took them). Streaks of expert slots start over. Returns
        this run's slots that moved."""
        if saved_ep == ep or not experts or experts % saved_ep or experts % ep:
            return []
        old_local, new_local = experts // saved_ep, experts // ep
        regrouped: Dict[str, dict] = {}
        for name in sorted(self.moved):
            match = _EXPERT_SLOT.match(name)
            if match is None:
                regrouped.setdefault(name, self.moved[name])
                continue
            slot = int(match["slot"])
            for rank in range(saved_ep):
                new_name = f"{match['head']}{(rank * old_local + slot) % new_local}{match['tail']}"
                entry = self.moved[name]
                if new_name in regrouped:
                    kept = regrouped[new_name]
                    entry = {"mode": _safer_of(kept["mode"], entry["mode"]),
                             "events": kept["events"] + [e for e in entry["events"] if e not in kept["events"]]}
                regrouped[new_name] = {"mode": dict(entry["mode"]), "events": list(entry["events"])}
        self.moved = regrouped
        self.streaks = {k: v for k, v in self.streaks.items() if _EXPERT_SLOT.match(k) is None}
        return sorted(n for n in regrouped if _EXPERT_SLOT.match(n))

    def reset(self) -> List[str]:
        """Forget every move (`--int8-reset-fallback`); returns the linears that had moved."""
        names = sorted(self.moved)
        self.moved, self.streaks = {}, {}
        return names


_EXPERT_SLOT = re.compile(r"^(?P<head>.*\.local_experts\.)(?P<slot>\d+)(?P<tail>\..*)$")


def _safer_of(a: dict, b: dict) -> dict:
    """Two fallback modes of one linear made one: each GEMM INT8 where both keep it, the finer scales of the two."""
    mode = {gemm: a[gemm] and b[gemm] for gemm in GEMMS}
    mode["granularity"] = b["granularity"] if b["granularity"] == FINER_GRANULARITY.get(a["granularity"]) else \
        a["granularity"]
    return mode


def _layer_modules(model_chunks, accept) -> Dict[str, torch.nn.Module]:
    """The modules `accept` takes inside the transformer layers, by a name that is the same under any pipeline
    split: 'layer<global layer number>.<path in the layer>'."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    if isinstance(model_chunks, torch.nn.Module):
        model_chunks = [model_chunks]
    found = {}
    for chunk in model_chunks:
        layers = {name: m.layer_number for name, m in chunk.named_modules() if isinstance(m, TransformerLayer)}
        for name, module in chunk.named_modules():
            if not accept(module):
                continue
            owner = max((p for p in layers if name.startswith(p + ".")), key=len, default=None)
            if owner is None:
                continue  # outside the transformer layers (the output layer's high-precision class)
            local = re.sub(r"^(module\.)+", "", name[len(owner) + 1:])
            found[f"layer{layers[owner]}.{local}"] = module
    return found


def int8_linears(model_chunks) -> Dict[str, "Int8LinearMixin"]:
    """Every INT8 linear of the transformer layers, e.g. 'layer3.mlp.linear_fc2' (`_layer_modules`)."""
    from ..megatron.layers import Int8LinearMixin  # here: the decisions above import without megatron-core

    return _layer_modules(model_chunks, lambda m: isinstance(m, Int8LinearMixin) and m.int8)


def int8_attentions(model_chunks) -> Dict[str, "SDPAttention"]:
    """Every core attention built to run INT8 (--int8-attention), e.g. 'layer3.self_attention.core_attention'."""
    from ..megatron.attention import SDPAttention

    return _layer_modules(model_chunks, lambda m: isinstance(m, SDPAttention) and m.int8_attention_built)


def attention_mode(module: "SDPAttention") -> dict:
    """An INT8 attention's mode as built."""
    return {"int8_attention": module.int8_attention_built}


def _fallback_note(entry: Optional[dict]) -> Optional[str]:
    return "; ".join(f"it {e['iteration']}: {e['gemm']} {e['change']}" for e in entry["events"]) if entry else None


def on_built_mode(built: dict, moved: dict) -> dict:
    """A move applied to the mode a linear was built with: each GEMM INT8 only where both are, and the move's
    finer scales only where they are the one step finer than the built ones. So a move saved by a run with other
    settings (a resume with --int8-granularity block or --int8-bf16-gemms wgrad) never brings back what this
    run's flags turned off; on the mode it was made from, it is the move itself."""
    mode = {gemm: built[gemm] and moved[gemm] for gemm in GEMMS}
    finer = moved["granularity"] == FINER_GRANULARITY.get(built["granularity"])
    mode["granularity"] = moved["granularity"] if finer else built["granularity"]
    return mode


def apply_fallback(linears: Dict[str, "Int8LinearMixin"], fallback: AutoFallback,
                   attentions: Optional[Dict[str, "SDPAttention"]] = None) -> List[str]:
    """Give every local linear (and INT8 attention) that moved its fallback mode, and the note the precision table
    shows; returns the names changed."""
    changed = []
    for name, module in linears.items():
        entry = fallback.moved.get(name)
        built = recipe_mode(module.int8_built_recipe)
        mode = on_built_mode(built, entry["mode"]) if entry else built
        recipe = dataclasses.replace(module.int8_built_recipe, **mode)
        module.int8_fallback_note = _fallback_note(entry)
        if recipe != module.int8_recipe:
            module.int8_recipe = recipe
            changed.append(name)
    for name, module in (attentions or {}).items():
        entry = fallback.moved.get(name)
        int8 = (entry["mode"] if entry else attention_mode(module))["int8_attention"]
        module.int8_fallback_note = _fallback_note(entry)
        if int8 != module.int8_attention:
            module.int8_attention = int8
            changed.append(name)
    return changed


class HealthMonitor:
    """Probes on every INT8 linear (and INT8 attention), armed every `interval` iterations; `collect` reads them
    (one sync)."""

    def __init__(self, linears: Dict[str, "Int8LinearMixin"], interval: int, fallback: AutoFallback,
                 attentions: Optional[Dict[str, "SDPAttention"]] = None):
        """`linears`: `int8_linears(model)`, `attentions`: `int8_attentions(model)`. Collective under pipeline
        parallelism (it gathers the stages' recipes)."""
        if interval < 1:
            raise ValueError(f"--int8-stats-interval must be >= 1, got {interval}")
        self.interval = interval
        self.fallback = fallback
        self.linears = linears
        self.attentions = attentions or {}
        self.built = built_modes(linears, self.attentions)
        self.probes = {}
        for name, module in self.linears.items():
            module.int8_probe = self.probes[name] = LinearProbe()
        for name, module in self.attentions.items():
            module.int8_probe = self.probes[name] = AttentionProbe()
        self.armed_iterations: List[int] = []

    def before_step(self, iteration: int) -> None:
        """Arm the probes when `iteration` (the one about to run) is a statistics step; disarm the ones the
        previous statistics step did not reach (an MoE expert without tokens), so that no later step's
        measurement is filed under it."""
        if iteration % self.interval == 0:
            for probe in self.probes.values():
                probe.arm()
            self.armed_iterations.append(iteration)
        elif (iteration - 1) % self.interval == 0:
            for probe in self.probes.values():
                probe.armed = False

    def collect(self) -> List[Tuple[int, Dict[str, Dict[str, float]]]]:
        """[(iteration, {linear: {stat: value}})] for every statistics step since the last call, over all
        pipeline stages, worst over tensor- and data-parallel ranks; NaN values (not measured) left out."""
        iterations, self.armed_iterations = self.armed_iterations, []
        if not iterations:
            return []
        names = sorted(self.probes)
        stats = {name: ATTENTION_STATS if name in self.attentions else STAT_NAMES for name in names}
        blocks = []
        for name in names:
            taken = self.probes[name].take_last(len(iterations))
            # a step whose training forward did not reach this unit leaves NaN (not measured)
            device = next((t.device for t in taken if t is not None), None) or training_device()
            missing = torch.full((len(stats[name]),), float("nan"), device=device)
            blocks.append(torch.stack([missing if t is None else t for t in taken]).reshape(-1))
        flat = _worst_over_replicas(torch.cat(blocks)).cpu() if blocks else None  # the one host sync
        local, start = {}, 0
        for name in names:
            size = len(iterations) * len(stats[name])
            local[name] = (stats[name], flat[start:start + size].reshape(len(iterations), -1))
            start += size
        gathered = _gather_over_pipeline(local)
        return [(it, {name: {s: float(v) for s, v in zip(names_, values[k].tolist()) if v == v}
                      for name, (names_, values) in sorted(gathered.items())})
                for k, it in enumerate(iterations)]

    def decide(self, checks) -> List[dict]:
        """Run the fallback decisions over `collect`'s checks in order and apply the moves to this rank's
        linears; returns the events. Every check of the batch measured the linears as they ran before the
        batch's moves, so a linear's checks after its move are left out."""
        events, moved = [], set()
        for iteration, by_linear in checks:
            for name, values in by_linear.items():
                if name not in moved:
                    new = self.fallback.check(iteration, name, self.built[name], values)
                    moved.update(e["linear"] for e in new)
                    events += new
        if events:
            apply_fallback(self.linears, self.fallback, self.attentions)
        return events

    def close(self) -> None:
        for module in (*self.linears.values(), *self.attentions.values()):
            module.int8_probe = None


def built_modes(linears: Dict[str, "Int8LinearMixin"],
                attentions: Optional[Dict[str, "SDPAttention"]] = None) -> Dict[str, dict]:
    """Each local linear's (and INT8 attention's) mode as built (before any fallback), gathered over pipeline
    stages."""
    local = {name: recipe_mode(m.int8_built_recipe) for name, m in linears.items()}
    local.update({name: attention_mode(m) for name, m in (attentions or {}).items()})
    return _gather_over_pipeline(local)


def _worst_over_replicas(table: torch.Tensor) -> torch.Tensor:
    """Element-wise MAX over the tensor- and data-parallel ranks (NaN kept where no rank measured)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return table
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return table
    table = torch.nan_to_num(table, nan=-math.inf)  # every statistic is >= 0: -inf marks "not measured"
    for group in (parallel_state.get_tensor_model_parallel_group(), parallel_state.get_data_parallel_group()):
        if torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(table, op=torch.distributed.ReduceOp.MAX, group=group)
    return torch.where(table == -math.inf, torch.full_like(table, math.nan), table)


def _gather_over_pipeline(local: dict) -> dict:
    """The union of every pipeline stage's dict (each stage holds other layers)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return local
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return local
    group = parallel_state.get_pipeline_model_parallel_group()
    size = torch.distributed.get_world_size(group)
    if size == 1:
        return local
    parts = [None] * size
    torch.distributed.all_gather_object(parts, local, group=group)
    merged = {}
    for part in parts:
        merged.update(part)
    return merged


def summarize(checks) -> str:
    """The log line's part: per GEMM the worst relative error and underflow of the last check, with the
    linear that has it."""
    if not checks:
        return ""
    iteration, by_linear = checks[-1]
    parts = []
    for gemm in GEMMS + (ATTENTION,):  # an attention's key appears where --int8-attention runs
        for stat, fmt in (("rel_err", ".2e"), ("underflow", ".3f")):
            key = f"{gemm}/{stat}"
            ranked = [(v[key], name) for name, v in by_linear.items() if key in v]
            if ranked:
                worst, name = max(ranked)
                parts.append(f"{gemm} {stat} {worst:{fmt}} ({name})")
    return f"int8 health (it {iteration}, worst): " + "; ".join(parts)


def scalars(by_linear: Dict[str, Dict[str, float]]) -> Dict[str, float]:
    """One check as flat scalar names: int8_health/<linear>/<operand or GEMM>/<stat>."""
    return {f"int8_health/{name}/{stat}": v for name, values in by_linear.items() for stat, v in values.items()}


class RunHealth:
    """What the trainer holds: the fallback state (always, since a checkpoint's moves apply to every resumed
    run) and, with `--int8-stats-interval`, the monitor."""

    def __init__(self, args, model_chunks):
        # a checkpoint's recorded arguments from before --int8-attention lack its threshold
        attention_limit = getattr(args, "int8_fallback_max_attention_rel_err", FallbackThresholds.max_attention_rel_err)
        thresholds = FallbackThresholds(max_rel_err=tuple(args.int8_fallback_max_rel_err),
                                        max_underflow=args.int8_fallback_max_underflow,
                                        patience=args.int8_fallback_patience, max_attention_rel_err=attention_limit)
        self.fallback = AutoFallback(thresholds, enabled=bool(args.int8_auto_fallback))
        self.linears = int8_linears(model_chunks)
        self.attentions = int8_attentions(model_chunks)
        self.reset_on_load = bool(args.int8_reset_fallback)
        self.monitor = (HealthMonitor(self.linears, args.int8_stats_interval, self.fallback, self.attentions)
                        if args.int8_stats_interval else None)

    def after_load(self, log) -> bool:
        """Apply the loaded moves (or drop them: --int8-reset-fallback); True, on every rank alike, where there
        are moves or --int8-reset-fallback was given (the caller then prints the precision table)."""
        if self.reset_on_load:
            dropped = self.fallback.reset()
            log("int8 fallback: --int8-reset-fallback: " + (f"{len(dropped)} module(s) back to their configured "
                                                            f"precision: {', '.join(dropped)}" if dropped else
                                                            "no fallback moves to drop"))
        apply_fallback(self.linears, self.fallback, self.attentions)
        built = built_modes(self.linears, self.attentions)  # over the pipeline stages: every rank calls this
        for name in sorted(self.fallback.moved) if self.linears or self.attentions else ():  # BF16: kept, unused
            mode = self.fallback.mode_of(name, built[name]) if name in built else self.fallback.moved[name]["mode"]
            log(f"int8 fallback restored from the checkpoint: {name} runs {describe_mode(mode)} "
                "(--int8-reset-fallback reverts it)")
        # the same answer on every rank (the moves are the checkpoint's, not this pipeline stage's): the caller
        # prints the precision table, a collective over the stages
        return bool(self.fallback.moved) or self.reset_on_load

    def before_step(self, iteration: int) -> bool:
        """Arm the probes for a statistics step; returns whether `iteration` is one."""
        if self.monitor is None:
            return False
        self.monitor.before_step(iteration)
        return iteration % self.monitor.interval == 0

    def at_log_line(self, logger) -> Tuple[str, bool]:
        """Read the interval's checks (one sync), log them, take the fallback decisions; returns (the log
        line's summary, whether a linear moved). Collective: every rank calls it at the same iterations."""
        if self.monitor is None:
            return "", False
        checks = self.monitor.collect()
        logger.int8_health(checks)
        events = self.monitor.decide(checks)
        for event in events:
            logger.int8_fallback(event)
        return summarize(checks), bool(events)

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()


def describe_mode(mode: dict) -> str:
    if "int8_attention" in mode:
        return "INT8 attention" if mode["int8_attention"] else "BF16 attention (SDPA)"
    gemms = "/".join(g if mode[g] else f"{g}:hp" for g in GEMMS)
    return f"{mode['granularity']} scales, {gemms}"
