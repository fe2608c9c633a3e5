"""The bench grids: each source document's table as rows of config overrides (a row turns on
what it names and nothing else), and the grids' former names."""

from __future__ import annotations

Row = tuple[str, dict[str, str]]

# The guide measured on bert-large with a classification head and random data: the same
# architecture scaled down to train on a CPU (a packaged config, 12.8M parameters), seq 128.
BERT = {"model.hf": "bert-cls-mini", "data.source": "synthetic", "model.seq_len": "128"}


def _guide_rows(model: dict[str, str], checkpointing_name: str) -> list[Row]:
    """The guide's rows on `model` (extra overrides of every row)."""
    rows: list[Row] = [
        ("vanilla (fp32)", {}),
        ("+ grad accumulation x4", {"train.micro_batch_size": "/4"}),
        (checkpointing_name, {"memory.checkpointing": "block"}),
        ("+ mixed precision (bf16)", {"train.precision": "bf16"}),
        ("+ adafactor", {"optim.name": "adafactor", "optim.lr": "1e-2"}),
        ("+ 8-bit adamw", {"optim.name": "adamw8bit"}),
        ("+ compile", {"train.compile": "default"}),
        (
            "everything",
            {
                "train.micro_batch_size": "/4",
                "memory.checkpointing": "block",
                "train.precision": "bf16",
                "optim.name": "adamw8bit",
                "train.compile": "default",
            },
        ),
    ]
    return [(name, {**model, **overrides}) for name, overrides in rows]


GRIDS: dict[str, list[Row]] = {
    # Hugging Face's "Efficient Training on a Single GPU", on a scaled-down BERT classifier as
    # the guide measured, and on the GPT
    "hf-guide-bert": _guide_rows(BERT, "+ gradient checkpointing"),
    "hf-guide": _guide_rows({}, "+ checkpointing (block)"),
    # Lippe's "Profiling and Scaling Single-GPU Transformer Models" (bf16 where its runs were)
    "lippe": [
        ("fp32", {}),
        ("bf16", {"train.precision": "bf16"}),
        # on JAX (tools/bench_backend.py): XLA compiles the unrolled layers whole; regional is scan
        (
            "bf16 + compile whole (JAX: unrolled)",
            {"train.precision": "bf16", "train.compile": "default"},
        ),
        (
            "bf16 + compile regional (JAX: scan)",
            {"train.precision": "bf16", "train.compile": "regional"},
        ),
        (
            "bf16 + remat attn+mlp (JAX: scanned)",
            {"train.precision": "bf16", "memory.checkpointing": "attn+mlp"},
        ),
        (
            "bf16 + remat block (JAX: scanned)",
            {"train.precision": "bf16", "memory.checkpointing": "block"},
        ),
        ("bf16 + accumulation x4", {"train.precision": "bf16", "train.micro_batch_size": "/4"}),
    ],
    # "Optimising the Training Loop": the naive loop against the optimised step
    "training-loop": [
        ("naive loop (fp32, full batch)", {}),
        (
            "optimized (bf16, remat attn+mlp, chunked loss, compile)",
            {
                "train.precision": "bf16",
                "memory.checkpointing": "attn+mlp",
                "memory.loss_chunk": "1024",
                "train.compile": "default",
            },
        ),
    ],
}


GRID_ALIASES = {
    "hf-bert": "hf-guide-bert",
    "hf": "hf-guide",
    "seed000": "lippe",
    "seed003": "training-loop",
}
"""The grids' former names, still accepted."""
