"""`memory.checkpointing` typed: the uniform policies, `every:K`, a per-block plan
(`blocks:...`), a budget the planner decides (`budget:BYTES`) and torch.compile's
(`budget-compiled:F`). Torch-free, like the rest of config/."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from onegpu.config.options import ConfigError

CHECKPOINTING_MODES = (
    "none",
    "attn",
    "mlp",
    "attn+mlp",
    "block",
    "every:K",
    "selective",
    "dots",
    "budget:BYTES",
    "blocks:P,P,...",
    "budget-compiled:FRACTION",
)
BLOCK_POLICIES = ("none", "selective", "attn", "mlp", "attn+mlp", "block")
"""What one block may do in a per-block plan (blocks:...), least recompute first."""


@dataclass(frozen=True, slots=True)
class Checkpointing:
    """`memory.checkpointing` parsed: which sub-modules recompute in backward."""

    kind: Literal[
        "none",
        "attn",
        "mlp",
        "attn+mlp",
        "block",
        "every",
        "selective",
        "dots",
        "budget",
        "blocks",
        "budget-compiled",
    ]
    every: int = 1
    """For kind 'every': checkpoint blocks 0, K, 2K, ..."""
    budget: int = 0
    """For kind 'budget': the bytes the step's planned peak must fit (0: budget:auto)."""
    per_block: tuple[str, ...] = ()
    """For kind 'blocks': each block's policy, one of BLOCK_POLICIES."""
    fraction: float = 1.0
    """For kind 'budget-compiled': torch's activation_memory_budget (0: recompute all it can,
    1: save what the default partitioner saves)."""

    def policy_of(self, block: int) -> str:
        """The uniform policy block `block` follows (kind 'every' and 'blocks' resolved)."""
        if self.kind == "blocks":
            return self.per_block[block]
        if self.kind == "every":
            return "block" if block % self.every == 0 else "none"
        return self.kind

    def recomputes_attention(self) -> bool:
        """Whether some block's backward runs its attention kernel again (a budget, planned
        later, may)."""
        recomputing = ("attn", "attn+mlp", "block")
        if self.kind == "blocks":
            return any(policy in recomputing for policy in self.per_block)
        return self.kind in (*recomputing, "every", "budget")


def parse_checkpointing(mode: str) -> Checkpointing:
    """The typed form of `memory.checkpointing` ('every:K' -> kind 'every', every=K; 'budget:N';
    'blocks:none*4,block*8')."""
    kind, _, arg = mode.partition(":")
    if kind == "every" and arg:
        if not arg.isdigit() or int(arg) < 1:
            raise ConfigError(
                "memory.checkpointing", f"{mode!r}: K must be a positive integer, e.g. every:2"
            )
        return Checkpointing(kind="every", every=int(arg))
    if kind == "budget" and arg:
        if arg != "auto" and not (arg.isdigit() and int(arg) > 0):
            raise ConfigError(
                "memory.checkpointing",
                f"{mode!r}: the budget is a number of bytes or auto, e.g. budget:8000000000",
            )
        return Checkpointing(kind="budget", budget=0 if arg == "auto" else int(arg))
    if kind == "blocks" and arg:
        return Checkpointing(kind="blocks", per_block=_per_block(mode, arg))
    if kind == "budget-compiled" and arg:
        try:
            fraction = float(arg)
        except ValueError:
            fraction = -1.0
        if not 0.0 <= fraction <= 1.0:
            raise ConfigError(
                "memory.checkpointing",
                f"{mode!r}: the fraction of the saved activations to keep is from 0 to 1, "
                "e.g. budget-compiled:0.5",
            )
        return Checkpointing(kind="budget-compiled", fraction=fraction)
    if mode not in CHECKPOINTING_MODES or ":" in mode:
        raise ConfigError(
            "memory.checkpointing", f"{mode!r} is not one of {', '.join(CHECKPOINTING_MODES)}"
        )
    return Checkpointing(kind=mode)  # type: ignore[arg-type]


def _per_block(mode: str, arg: str) -> tuple[str, ...]:
    """'none*2,block' -> ('none', 'none', 'block')."""
    out: list[str] = []
    for part in arg.split(","):
        policy, _, count = part.partition("*")
        if policy not in BLOCK_POLICIES or (count and not (count.isdigit() and int(count) > 0)):
            raise ConfigError(
                "memory.checkpointing",
                f"{mode!r}: {part!r} is not POLICY or POLICY*N with POLICY one of "
                f"{', '.join(BLOCK_POLICIES)}",
            )
        out += [policy] * (int(count) if count else 1)
    return tuple(out)


def per_block_mode(policies: list[str] | tuple[str, ...]) -> str:
    """The `memory.checkpointing` value of a per-block plan, runs of one policy as P*N."""
    runs: list[list] = []
    for p in policies:
        if runs and runs[-1][0] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    return "blocks:" + ",".join(p if n == 1 else f"{p}*{n}" for p, n in runs)
