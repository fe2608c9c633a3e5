"""The options themselves: one small dataclass per section, each field documented by the
string below it (`onegpu train --help` shows those strings). Pure data: nothing here builds."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_type_hints

from onegpu.config.data import DataConfig


class ConfigError(ValueError):
    """Bad user input: the CLI prints the message and exits with code 2."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field_name = field_name


Precision = Literal["auto", "fp32", "tf32", "bf16", "bf16-pure", "fp16"]


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    n_layer: int = 6
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; d_model must be divisible by it."""
    d_model: int = 256
    """Width of the residual stream."""
    seq_len: int = 256
    """Context length of the model: the number of learned positions."""
    vocab_size: int = 256
    """Rows of the embedding and output layers; may exceed the tokenizer's vocabulary (padding)."""
    pad_vocab_to: int = 64
    """Round the embedding and output rows up to a multiple of this (matrix units like it:
    GPT-2's 50,257 -> 50,304, as HF's single-GPU guide advises). Padded rows are never inputs and their logits are
    masked to -inf, so the model computes exactly the same function (1: no padding)."""
    mlp_ratio: int = 4
    """Hidden width of the MLP as a multiple of d_model."""
    dropout: float = 0.0
    """Dropout on embeddings, attention weights and residual branches (0 turns it off)."""
    bias: bool = True
    """Biases in linear layers and LayerNorms (GPT-2 has them)."""
    tie_embeddings: bool = True
    """Share the token embedding with the output layer (GPT-2 does)."""
    attention: Literal["auto", "sdpa", "flash", "efficient", "math", "plain", "blocked"] = "auto"
    """'auto': the fastest exact one here (sdpa on GPUs; on CPUs sdpa, plain or blocked, timed
    once and cached, compiled where the run compiles); 'sdpa': torch scaled_dot_product_attention, which picks its fastest
    kernel; 'flash', 'efficient', 'math': SDPA restricted to that kernel (an error if the device
    has none); 'plain': explicit softmax in model.softmax_dtype, the numerical reference;
    'blocked': batched matmuls over query blocks that skip the masked ones, fp32 scores and
    softmax, 16-bit probabilities saved for backward (CPUs: ~1.6x flash's speed, about T^2/2
    more memory a head; no dropout, no fp16)."""
    softmax_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the attention scores and softmax in 'plain' attention (Lippe's tutorial keeps it fp32)."""
    init_std: float = 0.02
    """Standard deviation of the GPT-2 initialisation (residual projections are scaled down)."""
    hf: str = ""
    """A local Hugging Face model folder to train instead of onegpu's GPT: its config.json sets
    the architecture (fields of [model] it fixes are refused), model.safetensors (optional) the
    starting weights, tokenizer.json (optional) the tokenizer of the data. Nothing is
    downloaded. model.seq_len sets the training context (at most the model's positions)."""
    init_from: str = ""
    """A model.safetensors in onegpu's GPT layout (a run folder's, from either backend) to start
    from instead of the random initialisation: the same weights train on torch and on JAX."""
    scan_layers: bool = False
    """JAX backend: the blocks as one `nn.scan` (one block compiled, its weights stacked), so
    compile time stays flat in depth (Lippe's tutorial). The torch backend refuses it: its
    counterpart is --train.compile regional."""
    hf_head: Literal["auto", "causal-lm", "sequence-classification"] = "auto"
    """The head of a model.hf model: 'auto' reads config.json's architectures (a
    ...ForSequenceClassification is a classifier, anything else a causal LM)."""

    @property
    def head_bias(self) -> bool:
        """Whether onegpu's GPT's output layer has a bias (untied; a model.hf head's is its own)."""
        return self.bias and not self.tie_embeddings and not self.hf

    @property
    def padded_vocab(self) -> int:
        """The vocabulary rounded up to pad_vocab_to (the padding rows' logits are -inf)."""
        step = max(1, self.pad_vocab_to)
        return -(-self.vocab_size // step) * step


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    batch_size: int = 16
    """Sequences per optimizer step (the global batch)."""
    micro_batch_size: int = 16
    """Sequences per forward/backward; batch_size / micro_batch_size micro-batches are accumulated."""
    max_steps: int = 200
    """Optimizer steps to run."""
    precision: Precision = "auto"
    """'fp32', 'tf32' (CUDA Ampere+), 'bf16' (autocast, fp32 master weights), 'bf16-pure' (bf16
    weights and gradients; fp32 optimizer moments, Kahan-compensated updates), 'fp16' (autocast +
    loss scaling), or 'auto': bf16 where native (on a CPU: measured 1.1x fp32), else tf32, fp32."""
    log_every: int = 10
    """Read metrics from the device every this many steps (the only host syncs of the loop)."""
    eval_every: int = 50
    """Evaluate on the validation split every this many steps and at the end (0: never)."""
    eval_batches: int = 8
    """Batches of train.micro_batch_size sequences per evaluation."""
    seed: int = 1337
    """Seed of weight init, data order and dropout."""
    device: str = "auto"
    """'auto' (CUDA if present, else CPU), 'cpu', 'cuda', 'cuda:N' or 'mps'."""
    compile: Literal["auto", "none", "default", "max-autotune", "regional"] = "auto"
    """torch.compile: 'default' or 'max-autotune' compile the whole forward and loss;
    'regional' compiles one transformer block and reuses it for every layer, so compile time
    stays flat in depth (like JAX's scan over layers). 'auto': a single-process run of at least
    100 steps times a micro-batch eager and compiled ('default', 'regional'; 'max-autotune' if
    long enough to repay it) once per device, model and settings (cached) and takes the mode
    saving the most over max_steps, compile included, else 'none' (docs/auto-defaults.md)."""
    loss_kernel: Literal["auto", "eager", "compiled"] = "auto"
    """The chunked loss's per-chunk math: 'compiled' fuses each chunk's softmax, log-sum-exp
    and gradient into one kernel (a CPU: onegpu's C++; a GPU: inductor's) and adds the head's
    gradient in one pass; 'eager': ATen's kernels. 'auto': compiled where a run of 100+ micro-batches'
    timing says it repays its compile (docs/auto-defaults.md); needs a C++ compiler or Triton."""
    gelu_kernel: Literal["auto", "eager", "compiled"] = "auto"
    """onegpu's GPT's tanh GELU where its blocks run eagerly: 'compiled' as two inductor kernels
    in its sigmoid form (the same function), 'eager' ATen's (slow on some CPUs); 'auto' as
    loss_kernel, on CPUs only (docs/auto-defaults.md)."""
    measure_memory: bool = False
    """Profile the second step's allocations to split peak memory into parameters, gradients,
    optimizer states, activations and the rest (summary.json 'memory'). Off by default: the
    profiled step is slow (minutes on a 100M+ model on a CPU) and the profiler's own memory
    raises the run's peak RSS; its time is left out of every speed figure. The same breakdown
    without a run: `onegpu plan` (predicted) or `onegpu profile` (measured)."""
    resume: str = ""
    """Continue a run: 'auto' (from the newest complete checkpoint in the run folder; none there:
    start afresh) or the path of a checkpoint file. Empty: a new run."""
    resume_new_data: bool = False
    """Resume even though the training data differs from the checkpoint's (its fingerprint is
    recorded in every checkpoint): the run continues at the same sample index of the new data.
    Off: such a resume is refused, naming data.source."""
    skip_memory_check: bool = False
    """Start even where the planner predicts the run does not fit (a single-process run plans
    its peak before it allocates anything and exits 2 with the planner's fixes otherwise)."""
    backend: Literal["torch", "jax"] = "torch"
    """'torch' (PyTorch) or 'jax' (JAX/Flax with optax: the same config, data order and run
    folder; install with `pip install onegpu[jax]`; docs/jax.md lists what it supports)."""
    xla_flags: str = "auto"
    """JAX backend: XLA's CPU options, set in XLA_FLAGS before XLA starts. 'none' (XLA's
    defaults), 'onednn' (--xla_cpu_use_onednn=true), 'ynn-dot' (YNNPACK's dot fusion), or the
    flags themselves (--train.xla_flags=--xla_...). 'auto': on a CPU, a run of at least 1,000
    steps times a few steps under none, onednn and ynn-dot, each in a process of its own, once
    per machine, jax version and run shape (cached), and keeps the fastest where it gains 5%
    over the defaults; shorter runs take a cached choice or the defaults; flags already in
    XLA_FLAGS are left as they are (docs/jax.md)."""
    max_consecutive_skips: int = 20
    """Stop the run (with a checkpoint from before the divergence) after this many updates in a
    row were skipped for non-finite loss or gradients."""


LOW_RANK_OPTIMIZERS = ("galore", "apollo", "apollo-mini")
"""Optimizers whose block matrices keep states of a low-rank projection (optim/low_rank.py)."""


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    name: Literal[
        "adamw",
        "adamw8bit",
        "adamw4bit",
        "adafactor",
        "sgd",
        "lamb",
        "lars",
        "galore",
        "apollo",
        "apollo-mini",
        "adam-mini",
    ] = "adamw"
    """Optimizer: 'adamw' (fused where available; 8 bytes of state per parameter), 'adamw8bit'
    (torchao's block-wise 8-bit moments, ~2 bytes), 'adamw4bit' (torchao's 4-bit moments, ~1
    byte), 'adafactor' (factored second moment, no first moment), 'sgd' (momentum optim.beta1;
    4 bytes), 'lamb' (Adam with a per-tensor trust ratio, for large batches; 8 bytes) and
    'lars' (momentum SGD with a per-tensor trust ratio; 4 bytes), both pytorch-optimizer's;
    'galore' (Adam on each block matrix's gradient projected to optim.rank dimensions by its
    SVD), 'apollo' (Adam moments of a random projection, used only to scale the raw gradient
    per channel), 'apollo-mini' (rank 1, one scale per tensor: almost no state) and
    'adam-mini' (one second moment per head or tensor: ~4 bytes), all pytorch-optimizer's
    (docs/optimizers.md)."""
    rank: int = 0
    """Projection rank of galore / apollo (0: the method's own default: galore 128, apollo
    256, apollo-mini 1). Only block matrices whose both sides exceed it are projected."""
    update_proj_gap: int = 200
    """Steps between new projections (galore: an SVD of the gradient; apollo: a new random
    matrix, drawn from a generator seeded by the step, so a resumed run draws the same)."""
    proj_scale: float = 0.0
    """Scale of the projected update (0: the method's default: galore 0.25, apollo 1,
    apollo-mini 128, pytorch-optimizer's `scale`)."""
    lr: float = 1e-3
    """Peak learning rate, reached after warmup (at optim.base_batch when lr_scaling is on)."""
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    """Scale optim.lr with the global batch against optim.base_batch: linearly (Goyal et al.,
    for SGD) or by the square root (the LAMB paper's rule for adaptive optimizers)."""
    base_batch: int = 0
    """The global batch (sequences) optim.lr was tuned at; required by lr_scaling."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only (not biases, norms, embeddings)."""
    beta1: float = 0.9
    """AdamW first-moment decay (also SGD momentum)."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW epsilon."""
    schedule: Literal["cosine", "exp", "constant"] = "cosine"
    """Learning-rate schedule after warmup: cosine to min_lr_ratio*lr, exponential decay
    by decay_rate per step (optax's warmup_exponential_decay_schedule), or constant."""
    warmup_steps: int = 20
    """Linear warmup from 0 over this many steps."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine schedule, as a fraction of lr."""
    decay_rate: float = 0.99
    """Per-step multiplier of the exponential schedule."""
    grad_clip: float = 1.0
    """Clip gradients to this global L2 norm (0: off)."""
    in_backward: bool = False
    """Step each parameter inside backward as soon as its gradient is ready, then free the
    gradient, so full gradients never coexist. Needs no accumulation and optim.grad_clip 0."""


@dataclass(kw_only=True, slots=True)
class MemoryConfig:
    checkpointing: str = "none"
    """Activation checkpointing: none, attn, mlp, attn+mlp, block, every:K, selective (save
    matmul outputs, recompute element-wise ops) or dots (save every matmul output, attention's
    batched ones too); budget:BYTES (or budget:auto: what the device has) picks a policy per
    block so the planned peak fits at the least recompute, written out as blocks:P,P,... (one
    policy per block, P*N for N blocks alike); budget-compiled:FRACTION hands the choice to
    torch.compile's partitioner (activation_memory_budget; needs compile, no dropout).
    Gradients are unchanged, dropout included."""
    offload_activations: bool = False
    """Keep saved activations (including checkpoints) in host memory until backward needs them."""
    offload_params: bool = False
    """Weights (and with them gradients and optimizer states) in host memory, each block
    gathered to the device for its forward and backward: FSDP2's CPUOffloadPolicy over a
    process group of one, no torchrun needed (under torchrun: dist.cpu_offload). Checkpoints
    are then DCP folders; the restrictions of [dist] apply (docs/offload.md)."""
    offload_optimizer: bool = False
    """Optimizer states and the weights it updates in host memory (ZeRO-Offload on one device):
    gradients leave the device as backward produces them, the step runs on the CPU, the updated
    weights are copied back. Any optimizer (8-bit AdamW then keeps 8-bit states on the host)."""
    offload_states: bool = False
    """Optimizer states in host memory, stepped on the device: each parameter's states cross
    the link just before its step and back after it (the next one's sent while it steps), so
    the CPU computes nothing (an 8-bit step on a CPU is slow) and the device holds the states
    of at most two parameters. With optim.in_backward each parameter steps as its gradient is
    whole; without, one at a time after backward. Any optimizer; 8-bit AdamW sends 2 bytes
    per parameter each way (docs/offload.md)."""
    offload_dir: str = ""
    """With memory.offload_optimizer: a folder on a local disk where the optimizer's states and
    its weight copies live in memory-mapped files (ZeRO-Infinity's disk tier), for when host
    memory is short; the gradient buffers stay in RAM. '' (default): all in host memory."""
    loss_chunk: int | Literal["auto"] = "auto"
    """Compute output layer + cross-entropy in chunks of this many tokens so the full
    [tokens, vocab] logits never exist (0: off; same loss and gradients). 'auto': on where the
    logits take at least 64 MiB and a quarter of a micro-batch's activations, with the chunk size that ran
    fastest here (timed once, cached), unless chunking is over 5% slower than the plain loss
    (docs/auto-defaults.md)."""
    gelu_bits: int = 0
    """Few-bit GELU backward (Novikov et al., "Few-Bit Backward"): save a k-bit code of GELU's input instead of the input,
    k in 1..4 (0: exact GELU)."""
    randomized_linear: float = 0.0
    """Randomized backward of block linear layers (Bershatsky et al.): save a random projection keeping
    this fraction of the rows of the input; unbiased weight gradients (0: off)."""


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    every: int = 0
    """Save a checkpoint every this many steps (0: only at the end and on interruption)."""
    keep_last: int = 3
    """Keep the newest this many checkpoints; older ones are deleted once a newer one is
    complete."""
    keep_every: int = 0
    """Never delete checkpoints of steps that are multiples of this (0: none kept apart)."""
    async_save: Literal["auto", "on", "off"] = "auto"
    """Sharded checkpoints (torchrun): 'on' copies this process's shards to host memory during
    the save and writes them in a background thread while training goes on (DCP's
    `async_save`); the folder becomes a checkpoint only once every process's write is done.
    Costs one host copy of the shards. 'auto': on where the state lives on a GPU (the copy is
    fast, the write is not), off on CPU (the state is in host memory already, so the copy costs
    what the write saves: see docs/distributed.md)."""


@dataclass(kw_only=True, slots=True)
class DistConfig:
    strategy: Literal["auto", "none", "fsdp", "ddp"] = "auto"
    """Several processes under `torchrun`: 'fsdp' shards parameters, gradients and optimizer
    states over the processes (FSDP2, `fully_shard` per block, then the root); 'ddp' keeps a
    full copy per process and all-reduces gradients; 'auto': fsdp when torchrun starts more than
    one process (WORLD_SIZE > 1), none otherwise; 'none': one process, no process group."""
    reshard_after_forward: bool = True
    """FSDP: free each block's gathered parameters after its forward and gather them again in
    backward (ZeRO-3: least memory); false keeps them to backward (ZeRO-2: one all-gather less
    per block per micro-batch, a block's full parameters more memory per block)."""
    cpu_offload: bool = False
    """FSDP: keep the sharded parameters, gradients and optimizer states in host memory (FSDP2's
    CPUOffloadPolicy, ZeRO-Offload's counterpart); the optimizer steps on the CPU, each block's
    parameters are copied to the device for its forward and backward (pinned where an
    accelerator exists)."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process-group backend: 'auto' is nccl on CUDA, gloo on CPU."""
    dp_replicate: int = 1
    """Data-parallel replicas: each holds the whole model (DDP) or, with dp_shard > 1, a whole
    FSDP group's shards (HSDP: shard within a group, all-reduce between groups). Under
    `dist.strategy ddp`, 1 means every process left once tp and pp are taken."""
    dp_shard: int = -1
    """Processes FSDP2 shards parameters, gradients and optimizer states over; -1: every
    process left once dp_replicate, tp and pp are taken (1 under `dist.strategy ddp`). The
    product dp_replicate x dp_shard x tp x pp is the world size."""
    tp: int = 1
    """Tensor parallelism (Megatron-style with sequence parallelism, as torchtitan applies it):
    each block's attention and MLP split over this many processes, column-wise then row-wise,
    the output layer by vocabulary with a loss that never gathers the logits. It must divide
    the heads, the (padded) vocabulary and the sequence."""
    pp: int = 1
    """Pipeline stages: the blocks split into this many stages by their planned cost (the
    embedding weighs on the first, the output layer and loss on the last)."""
    pp_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b"] = "1f1b"
    """The pipeline's schedule (torch.distributed.pipelining): 'gpipe' runs every micro-batch
    forward, then every backward (all micro-batches' activations alive); '1f1b' alternates
    once the pipe is full (at most pp in flight); 'interleaved-1f1b' gives each process two
    stages of fewer blocks (a smaller bubble, more sends)."""
    pp_microbatches: int = 0
    """Micro-batches one step's batch is cut into for the pipeline; 0: the step's own
    (batch_size / micro_batch_size / data-parallel processes). At least pp for 1f1b."""
    grad_compression: str = "none"
    """DDP's gradient all-reduce compressed by PyTorch's communication hooks: 'bf16' or 'fp16'
    (half the bytes), 'powersgd:RANK' (PowerSGD's rank-RANK factors with error feedback; its
    state is checkpointed, so resume stays exact); 'none'. Needs DDP (dist.strategy ddp)."""


@dataclass(kw_only=True, slots=True)
class OutConfig:
    dir: str = ""
    """Run folder (empty: runs/<date-time>). Must be new or empty unless out.overwrite is true."""
    overwrite: bool = False
    """Allow writing into a folder that already holds a run."""
    progress: bool = True
    """Show a progress bar."""
    tensorboard: bool = False
    """Also write the logged metrics (loss, lr, grad norm, tokens/s, MFU, memory, val loss) as
    TensorBoard events in DIR/tensorboard/ (needs the tensorboard package: `tensorboard
    --logdir DIR`)."""
    save_checkpoint: bool = True
    """Save checkpoints to DIR/checkpoints/ (at the end, on interruption and every
    checkpoint.every steps) and the final weights as DIR/model.safetensors."""


@dataclass(kw_only=True, slots=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    out: OutConfig = field(default_factory=OutConfig)

    @property
    def train_seq_len(self) -> int:
        return self.data.seq_len or self.model.seq_len

    @property
    def grad_accum_steps(self) -> int:
        return self.train.batch_size // self.train.micro_batch_size

    def sections(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


SECTIONS: dict[str, type] = get_type_hints(Config)
"""Section name -> its dataclass, in declaration order."""


HF_FIXED_FIELDS = (
    "n_layer",
    "n_head",
    "d_model",
    "vocab_size",
    "pad_vocab_to",
    "mlp_ratio",
    "dropout",
    "bias",
    "tie_embeddings",
    "softmax_dtype",
    "init_std",
)
"""[model] fields that a model.hf folder's config.json fixes: refused when given beside it."""


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return {s: dataclasses.asdict(obj) for s, obj in cfg.sections().items()}
