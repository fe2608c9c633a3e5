"""The device mesh a run's processes form: data-parallel replicas x FSDP shards x pipeline
stages x tensor-parallel ranks, from `[dist]` and the world size torchrun gives.

Torch-free: the validation, the planner and the tuner read it; `distributed/mesh.py` makes the
`DeviceMesh`. Dimensions in torchtitan's order, outermost first (pp, dp_replicate, dp_shard,
tp): tp innermost, so a tensor-parallel group is the nearest processes (one machine's NVLink),
pipeline stages the farthest apart (they send one activation per micro-batch).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from onegpu.config.options import Config, ConfigError, DistConfig, ModelConfig

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
COMPRESSION = re.compile(r"^(none|bf16|fp16|powersgd:([1-9][0-9]*))$")


@dataclass(frozen=True, slots=True)
class Layout:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def dp(self) -> int:
        """Processes that split the batch (the others split the model)."""
        return self.dp_replicate * self.dp_shard

    @property
    def data_parallel(self) -> str:
        """'fsdp' (HSDP when replicated too), 'ddp' or 'none'."""
        if self.dp_shard > 1:
            return "fsdp"
        return "ddp" if self.dp_replicate > 1 else "none"

    @property
    def splits_model(self) -> bool:
        return self.tp > 1 or self.pp > 1

    def sizes(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_DIMS}

    def describe(self) -> str:
        """'dp_shard 2 x tp 2' (the dimensions above 1)."""
        return " x ".join(f"{k} {n}" for k, n in self.sizes().items() if n > 1) or "one process"


def bubble(layout: Layout, schedule: str, micro_batches: int) -> float:
    """A pipeline's idle share: (pp - 1) / (m + pp - 1) for m micro-batches; with v stages per
    process (interleaved: 2) (pp - 1) / (v m + pp - 1)."""
    if layout.pp == 1:
        return 0.0
    v = 2 if schedule == "interleaved-1f1b" else 1
    return (layout.pp - 1) / (v * micro_batches + layout.pp - 1)


def resolve_layout(d: DistConfig, world_size: int) -> Layout:
    """The mesh of `world_size` processes; ConfigError naming the field when `[dist]` does not
    multiply to it. `dist.strategy` is the shorthand for the data-parallel dimension that takes
    the processes left: fsdp/auto -> dp_shard, ddp -> dp_replicate."""
    model = d.tp * d.pp
    if d.strategy == "ddp":
        _require(
            d.dp_shard in (-1, 1),
            "dist.dp_shard",
            "dist.strategy ddp replicates the whole model; set dist.dp_shard 1 (or -1), or use "
            "--dist.strategy fsdp with --dist.dp_replicate for HSDP",
        )
        replicate = d.dp_replicate if d.dp_replicate > 1 else max(1, world_size // model)
        layout = Layout(dp_replicate=replicate, dp_shard=1, tp=d.tp, pp=d.pp)
    else:
        left = max(1, world_size // (model * d.dp_replicate))
        shard = d.dp_shard if d.dp_shard != -1 else left
        layout = Layout(dp_replicate=d.dp_replicate, dp_shard=shard, tp=d.tp, pp=d.pp)
    _require(
        layout.world_size == world_size,
        "dist.dp_replicate x dp_shard x tp x pp",
        f"{layout.dp_replicate} x {layout.dp_shard} x {layout.tp} x {layout.pp} = "
        f"{layout.world_size} processes, but there are {world_size}: make the product "
        f"{world_size} (dp_shard -1 takes the processes left), or start "
        f"`torchrun --nproc-per-node {layout.world_size} -m onegpu train ...`",
    )
    _require(
        not (layout.splits_model and layout.data_parallel == "ddp"),
        "dist.strategy",
        "DDP cannot replicate tensor- or pipeline-parallel parameters; use FSDP on the "
        "data-parallel dimension (dist.strategy fsdp; with dist.dp_replicate: HSDP)",
    )
    return layout


def check_pipeline_batches(cfg: Config, layout: Layout) -> None:
    """A pipeline's micro-batches must split each data-parallel process's rows, and the 1F1B
    schedules need at least one per stage (interleaved: whole rounds of pp)."""
    if layout.pp == 1:
        return
    d, t = cfg.dist, cfg.train
    rows = t.batch_size // layout.dp
    n = d.pp_microbatches or rows // t.micro_batch_size
    field = "dist.pp_microbatches" if d.pp_microbatches else "train.micro_batch_size"
    _require(
        n >= 1 and rows % n == 0,
        field,
        f"{n} pipeline micro-batches do not split this process's {rows} rows of the batch",
    )
    _require(
        d.pp_schedule == "gpipe" or n >= layout.pp,
        field,
        f"{d.pp_schedule} needs at least {layout.pp} micro-batches a step (one per stage), this "
        f"layout has {n}: raise train.batch_size, or set dist.pp_microbatches",
    )
    _require(
        d.pp_schedule != "interleaved-1f1b" or n % layout.pp == 0,
        field,
        f"interleaved-1f1b runs micro-batches in rounds of {layout.pp} (pp); {n} is not a multiple",
    )


def check_layout(cfg: Config) -> None:
    """What `[dist]` asks of the model and the other sections, whatever the world size:
    checked when the config is loaded, before any process group exists."""
    d, m = cfg.dist, cfg.model
    for name in ("dp_replicate", "tp", "pp"):
        _require(getattr(d, name) >= 1, f"dist.{name}", "must be at least 1")
    _require(d.dp_shard >= 1 or d.dp_shard == -1, "dist.dp_shard", "must be -1 or at least 1")
    _require(d.pp_microbatches >= 0, "dist.pp_microbatches", "must be 0 (auto) or more")
    _require(
        COMPRESSION.match(d.grad_compression) is not None,
        "dist.grad_compression",
        f"{d.grad_compression!r} is not one of none, bf16, fp16, powersgd:RANK (e.g. powersgd:4)",
    )
    _require(
        d.grad_compression == "none" or d.strategy == "ddp",
        "dist.grad_compression",
        "compresses DDP's all-reduce (PyTorch's communication hooks); FSDP reduce-scatters "
        "shards instead: add --dist.strategy ddp, or set it to none",
    )
    _require(
        d.pp == 1 or not m.hf,
        "dist.pp",
        f"a pipeline of a Hugging Face model ({m.hf}) is not supported yet; train it with "
        "FSDP (dist.dp_shard) or tensor parallelism (dist.tp)",
    )
    if d.tp > 1:
        _check_tensor_parallel(cfg)
    if d.pp > 1:
        _check_pipeline(cfg)


def _check_pipeline(cfg: Config) -> None:
    d, m = cfg.dist, cfg.model
    stages = d.pp * (2 if d.pp_schedule == "interleaved-1f1b" else 1)
    _require(
        stages <= m.n_layer,
        "dist.pp",
        f"{stages} stages ({d.pp_schedule}) but the model has {m.n_layer} blocks; use at "
        f"most {m.n_layer // (stages // d.pp)}",
    )
    _require(
        not m.tie_embeddings,
        "model.tie_embeddings",
        "a tied embedding lives on the first pipeline stage and the output layer on the "
        "last; set it to false for pipeline parallelism",
    )
    _require(
        cfg.memory.loss_chunk in (0, "auto"),
        "memory.loss_chunk",
        "a pipeline's last stage computes its loss from the logits it outputs; set it to 0",
    )
    _require(
        not (cfg.memory.gelu_bits or cfg.memory.randomized_linear),
        "memory.gelu_bits" if cfg.memory.gelu_bits else "memory.randomized_linear",
        "is not supported with pipeline parallelism yet; turn it off",
    )


def _check_tensor_parallel(cfg: Config) -> None:
    d, mem = cfg.dist, cfg.memory
    for name, on in (
        ("memory.gelu_bits", bool(mem.gelu_bits)),
        ("memory.randomized_linear", bool(mem.randomized_linear)),
    ):
        _require(not on, name, "is not supported with tensor parallelism yet; turn it off")
    if not cfg.model.hf:  # an HF model's plan and sizes are checked where it is built
        _check_gpt_split(cfg.model, d.tp, cfg.train_seq_len)


def _check_gpt_split(m: ModelConfig, tp: int, seq: int) -> None:
    """Heads, vocabulary rows and the sequence must divide by tp."""
    _require(
        m.n_head % tp == 0,
        "dist.tp",
        f"{m.n_head} heads do not split over {tp} processes; use a divisor of {m.n_head}",
    )
    vocab = m.padded_vocab
    _require(
        vocab % tp == 0,
        "dist.tp",
        f"the vocabulary ({vocab} with padding) does not split over {tp} processes; set "
        f"model.pad_vocab_to to a multiple of {tp}",
    )
    _require(
        seq % tp == 0,
        "dist.tp",
        f"sequence parallelism splits the {seq} tokens of a sequence over {tp} processes; "
        f"use a sequence length that {tp} divides",
    )


def _require(cond: bool, key: str, message: str) -> None:
    if not cond:
        raise ConfigError(key, message)
