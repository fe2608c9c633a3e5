"""Pipeline parallelism on `torch.distributed.pipelining`: the blocks split into stages, one
(or, interleaved, two) per process of the mesh's pp dimension.

Each process keeps a copy of the model pruned to its stages' modules: the embedding on the
first stage, the final norm and the output layer on the last, its blocks under their own
indices, so every weight keeps its name (`blocks.5.mlp.fc.weight`) and a pipeline's checkpoint
loads at any other layout. A `StageView` runs one stage's part of the forward over that copy.

The split follows the cost of each piece, not the count of blocks: a block's matmuls and
attention per token, the output layer's 2 x d_model x vocab (its logits, softmax and loss), the
embedding nearly nothing. Contiguous stages minimise the most expensive stage.

Exactness: the schedule runs each micro-batch's forward and backward with the same summed,
token-normalised loss the single-process step uses (`scale_grads=False`: the loss is divided by
the global batch's target count already), so the gradients are the full batch's.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from onegpu.config import ModelConfig

SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
}


def stages_per_process(schedule: str) -> int:
    return 2 if schedule == "interleaved-1f1b" else 1


def piece_costs(m: ModelConfig, seq_len: int) -> tuple[float, list[float], float]:
    """(embedding, each block, output layer and loss): forward FLOPs per token."""
    d = m.d_model
    block = 2 * (4 * d * d + 2 * m.mlp_ratio * d * d) + 4 * seq_len * d
    head = 2 * d * m.padded_vocab + 5 * m.padded_vocab  # logits, then softmax and loss
    return 0.0, [float(block)] * m.n_layer, float(head)


def split_blocks(m: ModelConfig, seq_len: int, n_stages: int) -> list[range]:
    """Contiguous block ranges for `n_stages` stages, the most expensive stage as cheap as it
    can be (the embedding's cost lands on the first, the output layer's on the last)."""
    embed, blocks, head = piece_costs(m, seq_len)
    n = len(blocks)

    def cost(stage: int, first: int, last: int) -> float:
        extra = (embed if stage == 0 else 0.0) + (head if stage == n_stages - 1 else 0.0)
        return extra + sum(blocks[first:last])

    @functools.cache
    def best(stage: int, first: int) -> tuple[float, tuple[int, ...]]:
        """(cost of the worst stage, ends of stages `stage`..) for blocks from `first` on."""
        if stage == n_stages - 1:
            return cost(stage, first, n), (n,)
        options = []
        for end in range(first + 1, n - (n_stages - stage - 1) + 1):
            rest, ends = best(stage + 1, end)
            options.append((max(cost(stage, first, end), rest), (end, *ends)))
        return min(options)

    ends = best(0, 0)[1]
    starts = (0, *ends[:-1])
    return [range(a, b) for a, b in zip(starts, ends, strict=True)]


def stage_indices(pp_rank: int, pp: int, schedule: str) -> list[int]:
    """The stages this process runs: its own, and with interleaving also the one pp later."""
    return [pp_rank + k * pp for k in range(stages_per_process(schedule))]


def prune(model: nn.Module, keep: set[int], first: bool, last: bool) -> nn.Module:
    """`model` (in place) with only the blocks in `keep` and the ends it runs; every module
    left keeps its name."""
    for index in list(model.blocks._modules):
        if int(index) not in keep:
            del model.blocks._modules[index]
    if not first:
        model.wte = None
        model.wpe = None
    if not last:
        model.norm_f = None
        model.lm_head = None
    return model


class StageView(nn.Module):
    """One stage's forward over the pruned model: token ids or the residual stream in, the
    residual stream or (last stage) the logits out."""

    def __init__(self, model: nn.Module, blocks: range, first: bool, last: bool):
        super().__init__()
        self.model = model
        self.blocks, self.first, self.last = blocks, first, last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.stage(x, self.blocks, self.first, self.last)


def schedule_order(
    schedule: str, stages: list[int], pp: int, n_micro: int
) -> list[tuple[str, int, int]]:
    """The forwards ('F') and backwards ('B') of (stage, micro-batch) one process runs, in the
    order its schedule runs them: GPipe every forward first; 1F1B as many forwards as stages
    remain before the first backward, then one of each; interleaved 1F1B in rounds of `pp`
    micro-batches through its two stages (torch.distributed.pipelining's own orders). What
    matters for memory is how many forwards wait for their backward at once."""
    rank = stages[0] % pp
    if schedule == "interleaved-1f1b":
        rounds = [range(r, min(r + pp, n_micro)) for r in range(0, n_micro, pp)]
        forwards = [(s, mb) for mbs in rounds for s in stages for mb in mbs]
        backwards = [(s, mb) for mbs in rounds for s in reversed(stages) for mb in mbs]
        warmup = min((pp - rank - 1) * 2 + (len(stages) - 1) * pp, len(forwards))
    else:
        forwards = [(stages[0], mb) for mb in range(n_micro)]
        backwards = list(forwards)
        warmup = n_micro if schedule == "gpipe" else min(n_micro, pp - rank)
    order = [("F", *f) for f in forwards[:warmup]]
    for f, b in zip(forwards[warmup:], backwards, strict=False):
        order += [("B", *b), ("F", *f)]  # torch's steady phase: one backward, then one forward
    done_b = len(forwards) - warmup
    order += [("B", *b) for b in backwards[done_b:]]
    return order


class LocalSchedule:
    """A schedule's forwards and backwards for this process's stages, run here alone: what
    the neighbouring stages would send (activations, gradients) arrives as tensors of its
    shape. The planner follows it on fake tensors to see a stage's memory with its micro-batches
    in flight, without a schedule's start-up talk between processes."""

    def __init__(self, views, order, n_micro, loss_fn, shape, dtype, last_stage):
        self.views, self.order, self.n_micro = views, order, n_micro
        self.loss_fn, self.shape, self.dtype, self.last_stage = loss_fn, shape, dtype, last_stage

    def step(self, *args, target=None, losses=None):
        inputs = args[0].tensor_split(self.n_micro) if args else None
        targets = target.tensor_split(self.n_micro) if target is not None else None
        waiting = {}
        for op, stage, mb in self.order:
            if op == "F":
                if stage == 0:
                    x = inputs[mb]
                else:
                    x = torch.empty(self.shape, dtype=self.dtype, requires_grad=True)
                out = self.views[stage](x)
                if stage == self.last_stage:
                    out = self.loss_fn(out, targets[mb])
                    losses.append(out)
                waiting[(stage, mb)] = out
            else:
                out = waiting.pop((stage, mb))
                out.backward(None if stage == self.last_stage else torch.ones_like(out))


@dataclasses.dataclass
class Pipeline:
    """What a TrainStep runs instead of its micro-batch loop under pipeline parallelism."""

    schedule: object
    first: bool
    last: bool
    group: dist.ProcessGroup
    loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    views: dict[int, StageView] = dataclasses.field(default_factory=dict)
    ranges: list[range] = dataclasses.field(default_factory=list)
    micro_batches: int = 1
    n_stages: int = 1
    d_model: int = 0
    stream_len: int = 0
    activation_dtype: torch.dtype = torch.float32
    denominator: float = 1.0

    def forward_backward(self, inputs_BT: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        """One batch through every stage, forward and backward; the sum of this process's
        micro-batch losses (each divided by `denominator`) on the last stage, 0 elsewhere."""
        losses: list[torch.Tensor] = []
        args = (inputs_BT,) if self.first else ()
        kwargs = {"target": targets_BT, "losses": losses} if self.last else {}
        self.schedule.step(*args, **kwargs)
        if not losses:
            return torch.zeros((), device=inputs_BT.device)
        return torch.stack([loss.detach() for loss in losses]).sum()

    def loss(self, logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        """The last stage's loss (under tensor parallelism on vocabulary-sharded logits, in
        the step's `loss_parallel`), a plain tensor."""
        return local_value(self.loss_sum(logits_BTV, targets_BT)) / self.denominator

    @torch.no_grad()
    def evaluate(self, inputs_BT: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        """The summed loss of one batch, forward only, stage after stage (one batch whole: no
        schedule, whose micro-batches would have to divide it); on every process."""
        pp, me = self.group.size(), self.group.rank()
        x = inputs_BT
        for stage in range(self.n_stages):
            if stage in self.views:
                x = self.views[stage](x)
            owner, receiver = stage % pp, (stage + 1) % pp
            if stage == self.n_stages - 1 or owner == receiver:
                continue
            if me == owner:
                dist.send(x.contiguous(), group_dst=receiver, group=self.group)
            elif me == receiver:
                shape = (inputs_BT.shape[0], self.stream_len, self.d_model)
                x = torch.empty(shape, dtype=self.activation_dtype, device=inputs_BT.device)
                dist.recv(x, group_src=owner, group=self.group)
        total = local_value(self.loss_sum(x, targets_BT)) if self.last else torch.zeros(())
        total = total.to(device=inputs_BT.device, dtype=torch.float32)
        dist.all_reduce(total, group=self.group)  # the last stage's, on every stage
        return total


def local_value(value: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor (a DTensor's replicated value under tensor parallelism)."""
    return value.to_local() if hasattr(value, "to_local") else value


def build_pipeline(
    model: nn.Module,
    ranges: list[range],
    stages: list[int],
    *,
    schedule: str,
    n_microbatches: int,
    micro_batch: int,
    seq_len: int,
    stream_len: int,
    activation_dtype: torch.dtype,
    device: torch.device,
    group: dist.ProcessGroup,
    loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    planned: bool = False,
) -> Pipeline:
    """The schedule over this process's stages of the (pruned, already sharded) model;
    `planned`: the order of its schedule run here alone, for the planner's fake step.
    `stream_len`: the positions of the residual stream a stage passes on (`seq_len`, or its
    1/tp share under tensor parallelism's sequence parallelism)."""
    from torch.distributed import pipelining

    n_stages = len(ranges)
    views = {i: StageView(model, ranges[i], i == 0, i == n_stages - 1) for i in stages}
    pipe = Pipeline(
        schedule=None,
        first=0 in stages,
        last=n_stages - 1 in stages,
        group=group,
        loss_sum=loss_sum,
        views=views,
        ranges=ranges,
        micro_batches=n_microbatches,
        n_stages=n_stages,
        d_model=model.cfg.d_model,
        stream_len=stream_len,
        activation_dtype=activation_dtype,
    )
    if planned:  # a plan follows the schedule's order here alone (LocalSchedule)
        pipe.schedule = LocalSchedule(
            pipe.views,
            schedule_order(schedule, stages, group.size(), n_microbatches),
            n_microbatches,
            pipe.loss,
            (micro_batch, stream_len, model.cfg.d_model),
            activation_dtype,
            n_stages - 1,
        )
        return pipe
    stream = ((micro_batch, stream_len, model.cfg.d_model), activation_dtype)
    piped = _stages(views, n_stages, ((micro_batch, seq_len), torch.long), stream, device, group)
    kind = getattr(pipelining, SCHEDULES[schedule])
    one = piped if stages_per_process(schedule) > 1 else piped[0]
    pipe.schedule = kind(one, n_microbatches=n_microbatches, loss_fn=pipe.loss, scale_grads=False)
    return pipe


def _stages(
    views: dict[int, StageView],
    n_stages: int,
    tokens: tuple[tuple[int, ...], torch.dtype],
    stream: tuple[tuple[int, ...], torch.dtype],
    device: torch.device,
    group: dist.ProcessGroup,
) -> list:
    """torch's PipelineStage of each view, told the (shape, dtype) it takes in: token ids for
    the first stage, the residual stream for the others."""
    from torch.distributed import pipelining

    piped = []
    for index, view in views.items():
        shape, dtype = tokens if index == 0 else stream
        example = torch.empty(shape, dtype=dtype, device="meta")
        piped.append(
            pipelining.PipelineStage(view, index, n_stages, device, input_args=example, group=group)
        )
    return piped
