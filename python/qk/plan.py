"""``python -m qk.plan``: choose the layer ranges of a split (pipeline) deployment — which contiguous
layers each device serves so that every stage fits its memory and the slowest stage is as fast as
possible — and print the exact launch commands.

    python -m qk.plan M.gguf --device tron:20 --device midnight:48:0.6 --ctx 32768 --slots 2

Devices are given in stage order; the first is the head (it owns the embedding, layers start at 0),
the last serves the final norm and LM head. NAME is the host the stage runs on (``NAME@GPU`` adds
``--device GPU`` to its command), MEM_GiB its usable GPU memory, REL_SPEED its speed relative to the
others (default 1).

Memory of a stage (all formulas per device; ``GiB`` = 2**30 bytes):

* weights: exact ``nbytes`` of every ``blk.N.*`` tensor of its layers, plus ``token_embd`` on the
  head and ``output_norm`` + ``output`` on the last stage (``token_embd`` again if the LM head is tied).
* KV: per full-attention layer ``slots · ctx · Hkv · (key_length + value_length) · B_kv`` with
  ``B_kv`` the bytes of one KV element (``--kv-type``, as the engine stores them: f16 = 2 by default,
  f32 = 4 for ``--precise``, q8_0 = K in 34-byte blocks of 32 with V f16).
* DeltaNet state: per Gated DeltaNet layer per slot, conv ``(K−1) · conv_dim · 4`` plus
  S ``nv · dk · dv · 4`` (conv_dim = 2·nk·dk + nv·dv).
* snapshots (cross-turn reuse, mirrored on every stage): ``--snapshots N`` entries (default: one per
  slot), each a slot's full state for the stage's layers at the worst case (KV for all ctx positions
  + conv + S); or a flat ``--snapshot-gib G`` per stage.
* scratch (an estimate of the engine's activation buffers for one prefill chunk): with
  ``rows = max(chunk, slots)`` (chunk = 64, the DeltaNet chunk),
  ``4 · rows · (4·n_embd + 2·conv_dim + 2·nv + 3·nv·dv + 4·H·hd + 2·Hkv·hd + E + 2·k + 3·k·ff_exp
  + k·n_embd + 3·ff_shexp + 1)`` bytes on every stage (residuals, norms, mixer projections,
  router and expert activations), plus ``4 · nv · chunk · (dk + dv + chunk)`` for the chunked
  DeltaNet intermediates, plus ``4 · rows · vocab`` logits on the last stage. Attention is assumed
  to be a flash-style kernel (no ctx-sized score matrix).
* reserve: ``--reserve-gib`` (default 0.5) per device for the driver, the runtime and allocation
  rounding — the margin operators otherwise discover as an OOM at load.

Stage time = Σ per-layer cost / REL_SPEED. Per-layer cost = bytes read per decoded token: every
non-expert tensor of the layer (attention or DeltaNet projections, norms, router, shared expert) in
full, and the routed experts' tensors times k/E; the head adds one embedding row, the last stage the
LM head and final norm. ``--measure`` replaces the costs with times measured on the local adapter
through ``qk.Engine`` (one layer of each kind, and the LM head).

Every device gets at least one layer (a device that would slow the chain down is not dropped:
leave it out of the list). Network hops and per-frame overheads are not in the model. The planner
is exact: it first finds the smallest possible bottleneck (the slowest stage's time) by
dynamic programming over the stage boundaries, then, among the layouts reaching it, the one with the
smallest sum of stage times (the single-stream latency of a token). A layout that cannot fit is
refused with the shortfall of each device in the layout that comes closest (smallest largest
shortfall).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from qk.info import layer_kinds

GIB = 1 << 30
DEFAULT_BASE_PORT = 18100
DEFAULT_CHUNK = 64  # the DeltaNet prefill chunk; the head cuts prefill frames at its multiples
DEFAULT_RESERVE_GIB = 0.5
# Bytes per (K, V) element, by --kv-type, as the engine's cache types are: q8_0 is K in 34-byte
# blocks of 32 values beside an f16 V (--cache-type-k q8_0).
KV_TYPE_BYTES = {"f32": (4.0, 4.0), "f16": (2.0, 2.0), "q8_0": (34 / 32, 2.0)}
# Relative tolerance when comparing stage times with the optimal bottleneck: the times are sums of
# floats in different orders, so an exact tie can differ in the last bits.
TIME_RTOL = 1e-9


class PlanError(ValueError):
    """A layout that cannot be planned; ``shortfall_gib`` names the missing memory per device."""

    def __init__(self, message: str, shortfall_gib: dict[str, float] | None = None) -> None:
        super().__init__(message)
        self.shortfall_gib = shortfall_gib or {}


@dataclass(frozen=True)
class Device:
    """One stage's machine: ``NAME[@GPU]:MEM_GiB[:REL_SPEED]``."""

    name: str
    mem_gib: float
    speed: float = 1.0
    gpu: str | None = None

    @property
    def mem_bytes(self) -> int:
        return int(self.mem_gib * GIB)

    @classmethod
    def parse(cls, spec: str) -> Device:
        parts = spec.split(":")
        if len(parts) not in (2, 3) or not parts[0]:
            raise PlanError(f"--device {spec!r}: expected NAME[@GPU]:MEM_GiB[:REL_SPEED]")
        host, _, gpu = parts[0].partition("@")
        if not re.fullmatch(r"[A-Za-z0-9._\-]+", host):
            raise PlanError(f"--device {spec!r}: {host!r} is not a host name")
        try:
            mem = float(parts[1])
            speed = float(parts[2]) if len(parts) == 3 else 1.0
        except ValueError:
            raise PlanError(f"--device {spec!r}: MEM_GiB and REL_SPEED must be numbers") from None
        if not (math.isfinite(mem) and mem > 0):
            raise PlanError(f"--device {spec!r}: MEM_GiB must be positive")
        if not (math.isfinite(speed) and speed > 0):
            raise PlanError(f"--device {spec!r}: REL_SPEED must be positive")
        return cls(host, mem, speed, gpu or None)

    def __str__(self) -> str:
        return self.name + (f"@{self.gpu}" if self.gpu else "")


@dataclass(frozen=True)
class ModelFacts:
    """What the planner needs from a model file (all sizes in bytes)."""

    path: str
    arch: str
    kinds: tuple[str, ...]  # per main layer: "attention", "deltanet" (or "layer" for non-hybrid)
    layer_weight_bytes: tuple[int, ...]  # exact nbytes of blk.N.* per main layer
    layer_read_bytes: tuple[float, ...]  # bytes read per decoded token per layer
    head_weight_bytes: int  # token_embd
    head_read_bytes: float  # one embedding row
    tail_weight_bytes: int  # output_norm + output (or the tied token_embd)
    tail_read_bytes: float
    tied_lm_head: bool  # no output.weight: the last stage holds token_embd as its LM head
    kv_elements_per_position: int  # Hkv · (key_length + value_length) per attention layer
    k_elements_per_position: int  # Hkv · key_length
    v_elements_per_position: int  # Hkv · value_length
    deltanet_state_bytes: int  # conv + S per DeltaNet layer per slot
    conv_state_bytes: int
    ssm_state_bytes: int
    activation_floats_per_row: int
    deltanet_dims: tuple[int, int, int]  # (nv, dk, dv); zeros without DeltaNet layers
    vocab: int
    n_embd: int
    n_mtp: int = 0

    @property
    def n_layer(self) -> int:
        return len(self.kinds)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> ModelFacts:
        from qk.gguf import Gguf

        return cls.from_model(Gguf(path, header_only=True))

    @classmethod
    def from_model(cls, g: Any) -> ModelFacts:
        """From a ``qk.Gguf`` (header only is enough); ``PlanError`` on metadata it cannot use."""
        try:
            return cls._from_model(g)
        except (TypeError, ValueError) as e:
            if isinstance(e, PlanError):
                raise
            raise PlanError(f"{g.path}: unusable metadata: {e}") from None

    @classmethod
    def _from_model(cls, g: Any) -> ModelFacts:
        arch = g.arch
        if not arch:
            raise PlanError(f"{g.path}: no general.architecture")
        md = g.metadata

        def key(name: str, default: Any = None) -> Any:
            value = md.get(f"{arch}.{name}", default)
            if value is None:
                raise PlanError(f"{g.path}: metadata {arch}.{name} is missing")
            return value

        all_kinds = layer_kinds(md, arch)
        kinds = tuple(k for k in all_kinds if k != "mtp")
        n_layer = len(kinds)
        if n_layer == 0:
            raise PlanError(f"{g.path}: the model has no layers ({arch}.block_count)")
        if "layer" in kinds:
            raise PlanError(f"{g.path}: {arch} is not a hybrid DeltaNet/attention model qk serves")
        n_embd = int(key("embedding_length"))
        n_head = int(key("attention.head_count"))
        n_head_kv = int(key("attention.head_count_kv"))
        key_len = int(key("attention.key_length", n_embd // max(n_head, 1)))
        value_len = int(key("attention.value_length", key_len))
        n_expert = int(md.get(f"{arch}.expert_count", 0))
        n_used = int(md.get(f"{arch}.expert_used_count", 0))
        ff_exp = int(md.get(f"{arch}.expert_feed_forward_length", 0))
        ff_sh = int(md.get(f"{arch}.expert_shared_feed_forward_length", 0))
        has_deltanet = "deltanet" in kinds
        if has_deltanet:
            conv_k = int(key("ssm.conv_kernel"))
            dk = int(key("ssm.state_size"))
            nk = int(key("ssm.group_count"))
            nv = int(key("ssm.time_step_rank"))
            value_dim = int(key("ssm.inner_size"))
        else:
            conv_k = dk = nk = nv = value_dim = 0
        dv = value_dim // nv if nv else 0
        conv_dim = 2 * nk * dk + value_dim
        conv_bytes = (conv_k - 1) * conv_dim * 4 if has_deltanet else 0
        ssm_bytes = nv * dk * dv * 4

        weight = [0] * n_layer
        read = [0.0] * n_layer
        expert_fraction = n_used / n_expert if n_expert else 1.0
        blk = re.compile(r"blk\.(\d+)\.(.+)")
        for t in g.tensors:
            m = blk.fullmatch(t.name)
            if not m or int(m.group(1)) >= n_layer:
                continue  # globals, and MTP blocks (the main forward pass never runs them)
            i = int(m.group(1))
            weight[i] += t.nbytes
            read[i] += t.nbytes * (expert_fraction if "_exps." in t.name else 1.0)
        if "token_embd.weight" not in g:
            raise PlanError(f"{g.path}: no token_embd.weight")
        embd = g.tensor("token_embd.weight")
        vocab = embd.ne[1] if len(embd.ne) > 1 else 0
        tail_names = ["output_norm.weight", "output.weight" if "output.weight" in g else "token_embd.weight"]
        tail = [g.tensor(n) for n in tail_names if n in g]
        activation = (
            4 * n_embd
            + (2 * conv_dim + 2 * nv + 3 * value_dim if has_deltanet else 0)
            + 4 * n_head * key_len
            + 2 * n_head_kv * key_len
            + n_expert
            + 2 * n_used
            + 3 * n_used * ff_exp
            + n_used * n_embd
            + 3 * ff_sh
            + 1
        )
        return cls(
            path=g.path,
            arch=arch,
            kinds=kinds,
            layer_weight_bytes=tuple(weight),
            layer_read_bytes=tuple(read),
            head_weight_bytes=embd.nbytes,
            head_read_bytes=embd.nbytes / max(vocab, 1),
            tail_weight_bytes=sum(t.nbytes for t in tail),
            tail_read_bytes=float(sum(t.nbytes for t in tail)),
            tied_lm_head="output.weight" not in g,
            kv_elements_per_position=n_head_kv * (key_len + value_len),
            k_elements_per_position=n_head_kv * key_len,
            v_elements_per_position=n_head_kv * value_len,
            deltanet_state_bytes=conv_bytes + ssm_bytes,
            conv_state_bytes=conv_bytes,
            ssm_state_bytes=ssm_bytes,
            activation_floats_per_row=activation,
            deltanet_dims=(nv, dk, dv),
            vocab=vocab,
            n_embd=n_embd,
            n_mtp=len(all_kinds) - n_layer,
        )


@dataclass(frozen=True)
class Sizing:
    """The deployment's per-stage settings that memory depends on."""

    ctx: int
    slots: int
    kv_type: str = "f16"
    snapshots: int | None = None  # entries per stage; None with snapshot_gib None: one per slot
    snapshot_gib: float | None = None
    chunk: int = DEFAULT_CHUNK
    reserve_gib: float = DEFAULT_RESERVE_GIB

    def snapshot_count(self) -> int:
        return self.slots if self.snapshots is None else self.snapshots

    def validate(self) -> None:
        if self.ctx < 1 or self.slots < 1:
            raise PlanError("--ctx and --slots must be at least 1")
        if self.kv_type not in KV_TYPE_BYTES:
            raise PlanError(f"--kv-type {self.kv_type!r}: one of {', '.join(KV_TYPE_BYTES)}")
        if self.snapshots is not None and self.snapshot_gib is not None:
            raise PlanError("give --snapshots or --snapshot-gib, not both")
        if (self.snapshots or 0) < 0 or (self.snapshot_gib or 0) < 0 or self.reserve_gib < 0:
            raise PlanError("--snapshots, --snapshot-gib and --reserve-gib cannot be negative")
        if self.chunk < 1:
            raise PlanError("--chunk must be at least 1")


@dataclass(frozen=True)
class Memory:
    """A stage's memory, in bytes, by purpose."""

    weights: int
    kv: int
    deltanet: int
    snapshots: int
    scratch: int
    reserve: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.deltanet + self.snapshots + self.scratch + self.reserve


def layer_state_bytes(facts: ModelFacts, sizing: Sizing) -> list[int]:
    """Per main layer: one slot's state at full ctx (KV for attention, conv + S for DeltaNet)."""
    k_bytes, v_bytes = KV_TYPE_BYTES[sizing.kv_type]
    kv_position = facts.k_elements_per_position * k_bytes + facts.v_elements_per_position * v_bytes
    return [
        math.ceil(sizing.ctx * kv_position)
        if k == "attention"
        else facts.deltanet_state_bytes
        if k == "deltanet"
        else 0
        for k in facts.kinds
    ]


def stage_memory(facts: ModelFacts, sizing: Sizing, first: int, end: int) -> Memory:
    """Memory of a stage serving layers [first, end) — the formulas of the module docstring."""
    kinds = facts.kinds[first:end]
    state = layer_state_bytes(facts, sizing)[first:end]
    kv = sum(s for s, k in zip(state, kinds, strict=True) if k == "attention") * sizing.slots
    dn = sum(s for s, k in zip(state, kinds, strict=True) if k == "deltanet") * sizing.slots
    if sizing.snapshot_gib is not None:
        snaps = int(sizing.snapshot_gib * GIB)
    else:
        snaps = sizing.snapshot_count() * sum(state)
    weights = sum(facts.layer_weight_bytes[first:end])
    weights += facts.head_weight_bytes if first == 0 else 0
    weights += facts.tail_weight_bytes if end == facts.n_layer else 0
    weights -= both_ends_shared_bytes(facts) if first == 0 and end == facts.n_layer else 0
    scratch = scratch_bytes(facts, sizing) + (logits_bytes(facts, sizing) if end == facts.n_layer else 0)
    return Memory(weights, kv, dn, snaps, scratch, int(sizing.reserve_gib * GIB))


def scratch_bytes(facts: ModelFacts, sizing: Sizing) -> int:
    """Activation buffers of every stage: one prefill chunk (or one row per slot) of activations
    plus the chunked-DeltaNet intermediates W, U (chunk × dk, chunk × dv) and T (chunk × chunk)."""
    rows = max(sizing.chunk, sizing.slots)
    nv, dk, dv = facts.deltanet_dims
    return 4 * rows * facts.activation_floats_per_row + 4 * nv * sizing.chunk * (dk + dv + sizing.chunk)


def logits_bytes(facts: ModelFacts, sizing: Sizing) -> int:
    """The last stage's f32 logits for every row of a chunk."""
    return 4 * max(sizing.chunk, sizing.slots) * facts.vocab


def both_ends_shared_bytes(facts: ModelFacts) -> int:
    """A single stage with a tied LM head holds token_embd once, not as embedding and head."""
    return facts.head_weight_bytes if facts.tied_lm_head else 0


def fixed_bytes(facts: ModelFacts, sizing: Sizing) -> int:
    """Memory every stage needs whatever its layers: scratch, reserve, a flat snapshot budget."""
    snaps = int(sizing.snapshot_gib * GIB) if sizing.snapshot_gib is not None else 0
    return scratch_bytes(facts, sizing) + int(sizing.reserve_gib * GIB) + snaps


def stage_cost(facts: ModelFacts, costs: Costs, first: int, end: int) -> float:
    c = sum(costs.layer[first:end])
    c += costs.head if first == 0 else 0.0
    c += costs.tail if end == facts.n_layer else 0.0
    return c


@dataclass(frozen=True)
class Costs:
    """Per-token cost of each layer and of the head/tail extras; ``unit`` says what a cost is."""

    layer: tuple[float, ...]
    head: float
    tail: float
    unit: str  # "bytes" (read per token) or "s" (measured)

    @classmethod
    def from_bytes(cls, facts: ModelFacts) -> Costs:
        return cls(facts.layer_read_bytes, facts.head_read_bytes, facts.tail_read_bytes, "bytes")


# ---- the exact solver --------------------------------------------------------------------------


@dataclass
class Problem:
    """The planning problem in additive form: a stage serving [a, b) on device d needs
    ``fixed_mem[d] + Σ layer_mem[a:b] + head_mem·[a == 0] + tail_mem·[b == L]`` bytes and takes
    ``(Σ layer_cost[a:b] + head_cost·[a == 0] + tail_cost·[b == L]) / speed[d]``."""

    layer_cost: Sequence[float]
    layer_mem: Sequence[int]
    head_cost: float
    head_mem: int
    tail_cost: float
    tail_mem: int
    capacity: Sequence[int]
    fixed_mem: Sequence[int]
    speed: Sequence[float]
    shared_end_mem: int = 0  # counted once less when one stage holds both ends

    def __post_init__(self) -> None:
        self._cost_prefix = _prefix(self.layer_cost)
        self._mem_prefix = _prefix(self.layer_mem)

    @property
    def n_layer(self) -> int:
        return len(self.layer_cost)

    @property
    def n_device(self) -> int:
        return len(self.speed)

    def mem(self, d: int, a: int, b: int) -> int:
        m = self.fixed_mem[d] + self._mem_prefix[b] - self._mem_prefix[a]
        m += (self.head_mem if a == 0 else 0) + (self.tail_mem if b == self.n_layer else 0)
        return m - (self.shared_end_mem if a == 0 and b == self.n_layer else 0)

    def time(self, d: int, a: int, b: int) -> float:
        c = self._cost_prefix[b] - self._cost_prefix[a]
        c += (self.head_cost if a == 0 else 0.0) + (self.tail_cost if b == self.n_layer else 0.0)
        return c / self.speed[d]

    def over(self, d: int, a: int, b: int) -> int:
        return max(0, self.mem(d, a, b) - self.capacity[d])


def _prefix(values: Sequence[float]) -> list:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


def _min_max_dp(p: Problem, stage_value: Callable[[int, int, int], float], allowed) -> list[list[float]]:
    """best[d][b] = the smallest possible max over stages 0..d−1 (covering layers [0, b)) of
    ``stage_value``, using only stages ``allowed(d, a, b)`` accepts. Every stage holds ≥ 1 layer."""
    L, D = p.n_layer, p.n_device
    best = [[math.inf] * (L + 1) for _ in range(D + 1)]
    best[0][0] = 0.0
    for d in range(D):
        for b in range(d + 1, L - (D - d - 1) + 1):
            for a in range(d, b):
                if best[d][a] == math.inf or not allowed(d, a, b):
                    continue
                best[d + 1][b] = min(best[d + 1][b], max(best[d][a], stage_value(d, a, b)))
    return best


def _min_sum_path(p: Problem, stage_value: Callable[[int, int, int], float], allowed) -> list[int] | None:
    """Boundaries [0, b1, …, L] minimising Σ stage_value over stages ``allowed`` accepts."""
    L, D = p.n_layer, p.n_device
    best = [[math.inf] * (L + 1) for _ in range(D + 1)]
    back = [[-1] * (L + 1) for _ in range(D + 1)]
    best[0][0] = 0.0
    for d in range(D):
        for b in range(d + 1, L - (D - d - 1) + 1):
            for a in range(d, b):
                if best[d][a] == math.inf or not allowed(d, a, b):
                    continue
                v = best[d][a] + stage_value(d, a, b)
                if v < best[d + 1][b]:
                    best[d + 1][b], back[d + 1][b] = v, a
    if best[D][L] == math.inf:
        return None
    bounds = [L]
    for d in range(D, 0, -1):
        bounds.append(back[d][bounds[-1]])
    return bounds[::-1]


def solve(p: Problem) -> list[int]:
    """The boundaries [0, b1, …, L] of the layout with the smallest bottleneck among those where
    every stage fits, ties broken by the smallest sum of stage times. Raises ``PlanError`` (with the
    shortfall per device of the closest layout) when none fits."""
    if p.n_device == 0:
        raise PlanError("no devices given")
    if p.n_layer < p.n_device:
        raise PlanError(f"{p.n_device} devices but only {p.n_layer} layers: every stage needs a layer")

    def fits(d: int, a: int, b: int) -> bool:
        return p.mem(d, a, b) <= p.capacity[d]

    best = _min_max_dp(p, p.time, fits)
    bottleneck = best[p.n_device][p.n_layer]
    if bottleneck == math.inf:
        raise _refusal(p)
    limit = bottleneck * (1 + TIME_RTOL)
    bounds = _min_sum_path(p, p.time, lambda d, a, b: fits(d, a, b) and p.time(d, a, b) <= limit)
    if bounds is None:  # unreachable: the bottleneck layout itself qualifies
        raise PlanError("internal error: no layout reaches the optimal bottleneck")
    return bounds


def _refusal(p: Problem) -> PlanError:
    """The layout with the smallest largest shortfall (ties: smallest total), and its shortfalls."""
    always = lambda d, a, b: True  # noqa: E731
    best = _min_max_dp(p, lambda d, a, b: float(p.over(d, a, b)), always)
    worst = best[p.n_device][p.n_layer]
    bounds = _min_sum_path(
        p, lambda d, a, b: float(p.over(d, a, b)), lambda d, a, b: p.over(d, a, b) <= worst
    )
    assert bounds is not None
    short = [p.over(d, bounds[d], bounds[d + 1]) for d in range(p.n_device)]
    return PlanError("no layout fits", {str(d): s / GIB for d, s in enumerate(short)})


def bottleneck(p: Problem, bounds: Sequence[int]) -> float:
    return max(p.time(d, bounds[d], bounds[d + 1]) for d in range(p.n_device))


# ---- the plan ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    device: Device
    first: int
    end: int
    n_attention: int
    n_deltanet: int
    memory: Memory
    cost: float
    time: float  # cost / speed
    share: float  # of the sum of stage times
    port: int | None  # qkp port of a worker; None for the head

    @property
    def layers(self) -> str:
        return f"{self.first}:{self.end}"

    @property
    def free(self) -> int:
        return self.device.mem_bytes - self.memory.total


@dataclass(frozen=True)
class Plan:
    model: str
    facts: ModelFacts
    sizing: Sizing
    costs: Costs
    stages: list[Stage]
    bottleneck: float  # the slowest stage's time
    total_time: float  # sum of stage times: single-stream latency per token
    ideal: float  # Σ costs / Σ speeds: the bottleneck of a perfectly divisible model
    speed_only: float  # the best bottleneck were memory unlimited: below `bottleneck` = memory-bound
    commands: list[str] = field(default_factory=list)


def plan(
    model: str | os.PathLike[str] | ModelFacts,
    devices: Sequence[Device | str],
    ctx: int,
    slots: int,
    *,
    snapshots: int | None = None,
    snapshot_gib: float | None = None,
    kv_type: str = "f16",
    reserve_gib: float = DEFAULT_RESERVE_GIB,
    chunk: int = DEFAULT_CHUNK,
    base_port: int = DEFAULT_BASE_PORT,
    costs: Costs | None = None,
) -> Plan:
    """Plan the split of ``model`` over ``devices`` (stage order; the first is the head). Memory
    formulas and the cost model: module docstring. ``costs`` overrides the bytes-read cost model
    (``measure_costs`` produces one). Raises ``PlanError`` when no layout fits, naming the shortfall
    in GiB of each device."""
    facts = model if isinstance(model, ModelFacts) else ModelFacts.from_gguf(model)
    devs = [d if isinstance(d, Device) else Device.parse(d) for d in devices]
    sizing = Sizing(ctx, slots, kv_type, snapshots, snapshot_gib, chunk, reserve_gib)
    sizing.validate()
    costs = costs or Costs.from_bytes(facts)
    if len(costs.layer) != facts.n_layer:
        raise PlanError(f"{len(costs.layer)} layer costs for {facts.n_layer} layers")
    if not 1 <= base_port <= 65535 - max(len(devs) - 2, 0):
        raise PlanError(f"--base-port {base_port} leaves no room for {len(devs) - 1} worker ports")

    problem = _problem(facts, sizing, costs, devs)
    try:
        bounds = solve(problem)
    except PlanError as e:
        if not e.shortfall_gib:
            raise
        raise _named_refusal(facts, sizing, devs, e) from None

    stages = []
    times = [problem.time(d, bounds[d], bounds[d + 1]) for d in range(len(devs))]
    total = sum(times)
    for d, dev in enumerate(devs):
        a, b = bounds[d], bounds[d + 1]
        kinds = facts.kinds[a:b]
        stages.append(
            Stage(
                device=dev,
                first=a,
                end=b,
                n_attention=kinds.count("attention"),
                n_deltanet=kinds.count("deltanet"),
                memory=stage_memory(facts, sizing, a, b),
                cost=stage_cost(facts, costs, a, b),
                time=times[d],
                share=times[d] / total if total > 0 else 1.0 / len(devs),
                port=None if d == 0 else base_port + d - 1,
            )
        )
    all_cost = sum(costs.layer) + costs.head + costs.tail
    ideal = all_cost / sum(dev.speed for dev in devs)
    unlimited = dataclasses.replace(problem, capacity=[math.inf] * len(devs))
    speed_only = bottleneck(unlimited, solve(unlimited))
    result = Plan(os.fspath(facts.path), facts, sizing, costs, stages, max(times), total, ideal, speed_only)
    result.commands.extend(launch_commands(result))
    return result


def _problem(facts: ModelFacts, sizing: Sizing, costs: Costs, devs: Sequence[Device]) -> Problem:
    """The additive form of ``stage_memory``/``stage_cost`` (a test checks they agree)."""
    state = layer_state_bytes(facts, sizing)
    per_slot_snaps = 0 if sizing.snapshot_gib is not None else sizing.snapshot_count()
    layer_mem = [
        w + s * (sizing.slots + per_slot_snaps) for w, s in zip(facts.layer_weight_bytes, state, strict=True)
    ]
    return Problem(
        layer_cost=costs.layer,
        layer_mem=layer_mem,
        head_cost=costs.head,
        head_mem=facts.head_weight_bytes,
        tail_cost=costs.tail,
        tail_mem=facts.tail_weight_bytes + logits_bytes(facts, sizing),
        capacity=[d.mem_bytes for d in devs],
        fixed_mem=[fixed_bytes(facts, sizing)] * len(devs),
        speed=[d.speed for d in devs],
        shared_end_mem=both_ends_shared_bytes(facts),
    )


def _named_refusal(facts: ModelFacts, sizing: Sizing, devs: Sequence[Device], e: PlanError) -> PlanError:
    """``solve``'s refusal (shortfalls by stage index) told in device names, with what to change."""
    short = {
        str(devs[int(k)]) + (f"#{k}" if sum(str(x) == str(devs[int(k)]) for x in devs) > 1 else ""): v
        for k, v in e.shortfall_gib.items()
    }
    need = sum(facts.layer_weight_bytes) + facts.head_weight_bytes + facts.tail_weight_bytes
    lines = [
        f"cannot split {facts.n_layer} layers of {os.path.basename(facts.path)} over {len(devs)} device(s) "
        f"at ctx {sizing.ctx} × {sizing.slots} slot(s): no layout fits.",
        f"  weights alone: {need / GIB:.2f} GiB; capacity: {sum(d.mem_bytes for d in devs) / GIB:.2f} GiB in all",
        "  shortfall of the closest layout (GiB per device):",
    ]
    for name, gib in short.items():
        lines.append(f"    {name}: {'short by ' + format(gib, '.2f') + ' GiB' if gib > 0 else 'fits'}")
    lines.append("  add memory or devices, or lower --ctx / --slots / --snapshots (or use --kv-type q8_0).")
    return PlanError("\n".join(lines), short)


# ---- launch commands ---------------------------------------------------------------------------


def launch_commands(p: Plan) -> list[str]:
    """The head's ``qk.serve`` command, then each worker's ``qk.worker`` command (docs/architecture.md
    "Command lines"). Workers bind every interface, so the qkp secret is required; it is read from
    ``$QK_SECRET`` on each machine (the same value everywhere) rather than printed."""
    model = shlex.quote(p.model)
    sizing = f"--slots {p.sizing.slots} --ctx {p.sizing.ctx}"
    out = []
    for d, st in enumerate(p.stages):
        gpu = f" --device {shlex.quote(st.device.gpu)}" if st.device.gpu else ""
        nxt = p.stages[d + 1] if d + 1 < len(p.stages) else None
        if d == 0:
            if nxt is None:
                out.append(f"python -m qk.serve --model {model} {sizing}{gpu}")
            else:
                out.append(
                    f"python -m qk.serve --model {model} --layers {st.layers} "
                    f'--split-next {nxt.device.name}:{nxt.port} {sizing}{gpu} --secret "$QK_SECRET"'
                )
        else:
            chain = f" --next {nxt.device.name}:{nxt.port}" if nxt else ""
            out.append(
                f"python -m qk.worker --model {model} --layers {st.layers} --host 0.0.0.0 --port {st.port}"
                f'{chain} {sizing}{gpu} --secret "$QK_SECRET"'
            )
    return out


# ---- measured costs ----------------------------------------------------------------------------


def find_engine() -> Any:
    """``qk.Engine`` (or the native ``qk._qk.Engine``); ``PlanError`` if this build has none."""
    import qk

    for get in (lambda: qk.Engine, lambda: __import__("qk._qk", fromlist=["Engine"]).Engine):
        try:
            return get()
        except (AttributeError, ImportError):
            continue
    raise PlanError(
        "--measure needs qk.Engine, which this build of qk does not have (the engine is not built in); "
        "plan without --measure to use the bytes-read-per-token cost model"
    )


def measure_costs(
    path: str | os.PathLike[str],
    facts: ModelFacts,
    *,
    tokens: int = 16,
    engine_factory: Callable[..., Any] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Costs:
    """Seconds per decoded token of each layer on the local adapter. One layer of each kind is timed
    (away from the ends, so without the embedding or the LM head) over ``tokens`` single-token steps
    after one warm-up step; other layers of that kind cost the same seconds per byte read. The LM head
    is the time of the last layer's stage minus that layer's, the embedding likewise on layer 0
    (clamped at 0: a lookup is below the timing noise)."""
    factory = engine_factory or find_engine()
    import numpy as np

    L = facts.n_layer
    path = os.fspath(path)
    rng = np.random.default_rng(0)

    def seconds_per_token(first: int, end: int) -> float:
        eng = factory(path, layers=(first, end), slots=1, ctx=tokens + 1)
        if first == 0:
            rows = [[(7 * j + 1) % max(facts.vocab, 1)] for j in range(tokens + 1)]
        else:
            rows = [rng.standard_normal((1, facts.n_embd)).astype(np.float32) for _ in range(tokens + 1)]
        eng.stage_run(0, rows[0], 0)  # warm-up: pipelines and bind groups are created here
        start = clock()
        for j in range(1, tokens + 1):
            eng.stage_run(0, rows[j], j)
        return (clock() - start) / tokens

    if L == 1:
        return Costs((seconds_per_token(0, 1),), 0.0, 0.0, "s")
    per_byte: dict[str, float] = {}
    for kind in sorted(set(facts.kinds)):
        where = [i for i, k in enumerate(facts.kinds) if k == kind]
        i = next((j for j in where if 0 < j < L - 1), where[0])
        # A kind found only at an end layer is timed with the embedding or LM head included; the
        # head/tail differences below then come out as zero rather than counting them twice.
        per_byte[kind] = seconds_per_token(i, i + 1) / max(facts.layer_read_bytes[i], 1.0)
    layer = tuple(per_byte[k] * facts.layer_read_bytes[i] for i, k in enumerate(facts.kinds))
    head = max(0.0, seconds_per_token(0, 1) - layer[0])
    tail = max(0.0, seconds_per_token(L - 1, L) - layer[L - 1])
    return Costs(layer, head, tail, "s")


# ---- output ------------------------------------------------------------------------------------


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def _cost(costs: Costs, value: float) -> str:
    return f"{value / GIB:.3f}" if costs.unit == "bytes" else f"{1e3 * value:.3f}"


def format_plan(p: Plan) -> str:
    f, s = p.facts, p.sizing
    n_attn, n_dn = f.kinds.count("attention"), f.kinds.count("deltanet")
    snaps = (
        f"{s.snapshot_gib:g} GiB per stage"
        if s.snapshot_gib is not None
        else f"{s.snapshot_count()} per stage (each a slot's full state at ctx)"
    )
    unit = "bytes read per token" if p.costs.unit == "bytes" else "measured seconds per token on this adapter"
    cost_head = "GiB/token" if p.costs.unit == "bytes" else "ms/token"
    lines = [
        f"model: {p.model} ({f.arch}, {f.n_layer} layers: {n_attn} attention, {n_dn} DeltaNet"
        + (f"; {f.n_mtp} MTP skipped" if f.n_mtp else "")
        + ")",
        f"sizing: ctx {s.ctx} per slot × {s.slots} slot(s); KV {s.kv_type} (K {KV_TYPE_BYTES[s.kv_type][0]:g} B, "
        f"V {KV_TYPE_BYTES[s.kv_type][1]:g} B per element); snapshots {snaps}; reserve {s.reserve_gib:g} GiB per device",
        f"cost model: {unit}; stage time = cost / REL_SPEED",
        "",
        f"{'stage':<7}{'device':<18}{'speed':>6}  {'layers':<8}{'attn/DN':>8}{cost_head:>12}  {'time share':>10}",
    ]
    for d, st in enumerate(p.stages):
        role = "head" if d == 0 else f"w{d}"
        mark = (
            "  <- bottleneck"
            if math.isclose(st.time, p.bottleneck, rel_tol=TIME_RTOL) and len(p.stages) > 1
            else ""
        )
        lines.append(
            f"{role:<7}{str(st.device):<18}{st.device.speed:>6g}  {st.layers:<8}"
            f"{f'{st.n_attention}/{st.n_deltanet}':>8}{_cost(p.costs, st.cost):>12}  {100 * st.share:>9.1f}%{mark}"
        )
    if p.costs.unit == "s":
        lines.append(
            f"predicted: {1e3 * p.bottleneck:.2f} ms bottleneck (≈ {1 / p.bottleneck:.1f} tok/s with "
            f"the pipeline full), {1e3 * p.total_time:.2f} ms per token for one stream"
        )
    lines.append(
        f"balance: slowest stage {p.bottleneck / p.ideal:.3f}× the ideal (Σ cost / Σ speed, a perfectly "
        "divisible model); contiguous ranges, each device at least one layer"
    )
    if p.bottleneck > p.speed_only * (1 + TIME_RTOL):
        full = [f"{st.device} ({_gib(st.free)} GiB free)" for st in p.stages if st.free < 2 * GIB]
        lines.append(
            f"memory-bound: with unlimited memory the slowest stage would be {p.bottleneck / p.speed_only:.2f}× "
            f"faster; more memory on {', '.join(full) or 'the fuller devices'} would let "
            f"{'it' if len(full) == 1 else 'them'} take more layers"
        )
    lines += [
        "",
        "memory per device (GiB):",
        f"{'device':<18}{'weights':>9}{'KV':>8}{'DN state':>9}{'snaps':>8}{'scratch':>8}{'reserve':>8}"
        f"{'total':>8}{'capacity':>9}{'free':>7}",
    ]
    for st in p.stages:
        m = st.memory
        lines.append(
            f"{str(st.device):<18}{_gib(m.weights):>9}{_gib(m.kv):>8}{_gib(m.deltanet):>9}{_gib(m.snapshots):>8}"
            f"{_gib(m.scratch):>8}{_gib(m.reserve):>8}{_gib(m.total):>8}{_gib(st.device.mem_bytes):>9}"
            f"{_gib(st.free):>7}"
        )
    lines += [
        "",
        "launch (the model file at the same path on every machine; any order, the head connects lazily):",
    ]
    if len(p.stages) > 1:
        lines.append(
            "  export QK_SECRET=...   # the same secret on every machine: "
            "python -c 'import secrets; print(secrets.token_hex(16))'"
        )
    for d in list(range(1, len(p.commands))) + [0]:
        lines.append(f"  [{p.stages[d].device.name}] {p.commands[d]}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m qk.plan",
        description="Choose the layer ranges of a split deployment and print the launch commands.",
    )
    ap.add_argument("model", help="the GGUF file (the first shard of a split model); only its header is read")
    ap.add_argument(
        "--device",
        action="append",
        required=True,
        metavar="NAME[@GPU]:MEM_GiB[:REL_SPEED]",
        help="a stage's host, usable GPU memory and relative speed; repeat, in stage order (head first)",
    )
    ap.add_argument("--ctx", type=int, required=True, help="positions per slot")
    ap.add_argument("--slots", type=int, required=True, help="concurrent sequences")
    snap = ap.add_mutually_exclusive_group()
    snap.add_argument("--snapshots", type=int, help="state snapshots per stage (default: one per slot)")
    snap.add_argument("--snapshot-gib", type=float, help="snapshot budget per stage in GiB")
    ap.add_argument(
        "--kv-type",
        default="f16",
        choices=sorted(KV_TYPE_BYTES),
        help="KV cache type as the stages will run (default f16, the engine's; f32 with --precise; "
        "q8_0 = --cache-type-k q8_0)",
    )
    ap.add_argument(
        "--reserve-gib",
        type=float,
        default=DEFAULT_RESERVE_GIB,
        help=f"headroom per device for driver and runtime (default {DEFAULT_RESERVE_GIB})",
    )
    ap.add_argument("--chunk", type=int, default=DEFAULT_CHUNK, help="prefill rows per call (scratch size)")
    ap.add_argument("--base-port", type=int, default=DEFAULT_BASE_PORT, help="the first worker's qkp port")
    ap.add_argument(
        "--measure",
        action="store_true",
        help="time one layer of each kind on the local adapter (qk.Engine) instead of counting bytes",
    )
    a = ap.parse_args(argv)
    try:
        facts = ModelFacts.from_gguf(a.model)
        costs = measure_costs(a.model, facts) if a.measure else None
        result = plan(
            facts,
            a.device,
            a.ctx,
            a.slots,
            snapshots=a.snapshots,
            snapshot_gib=a.snapshot_gib,
            kv_type=a.kv_type,
            reserve_gib=a.reserve_gib,
            chunk=a.chunk,
            base_port=a.base_port,
            costs=costs,
        )
    except (PlanError, OSError) as e:
        print(f"qk.plan: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # qk.GgufError and the engine's errors come from the native module
        if type(e).__module__.startswith("qk"):
            print(f"qk.plan: {e}", file=sys.stderr)
            return 2
        raise
    print(format_plan(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
