"""A GPT-2-style decoder: architecture only, no training infrastructure.

Shape suffixes: B batch, T time (sequence), D d_model, H heads, K head dim, F MLP hidden, V vocab.

Blocks are pre-norm and split into two residual branches, `attn` and `mlp`, each holding its own
LayerNorm, so that techniques can wrap either branch (the two Lippe's tutorial rematerialises).
Build under `torch.device("meta")`, move with `to_empty(device=...)`, then `init_weights()`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from onegpu.config import ModelConfig
from onegpu.models.blocked_attention import blocked_attention
from onegpu.models.documents import document_mask
from onegpu.models.qkv import split_fused_qkv
from onegpu.perf.logits import padded_vocab

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SDPA_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def plain_attention(
    q_BHTK: torch.Tensor,
    k_BHTK: torch.Tensor,
    v_BHTK: torch.Tensor,
    *,
    dropout_p: float = 0.0,
    softmax_dtype: torch.dtype = torch.float32,
    mask_B1TT: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention with scores and softmax in `softmax_dtype` (the numerically safe softmax of Lippe's tutorial).
    `mask_B1TT`: where to attend instead of the causal mask (packed documents).

    Autocast is switched off around the score matmul, else it would cast the fp32 operands
    straight back to bf16/fp16 and defeat the point.
    """
    T, K = q_BHTK.shape[-2], q_BHTK.shape[-1]
    with torch.autocast(q_BHTK.device.type, enabled=False):
        q = q_BHTK.to(softmax_dtype) * K**-0.5
        scores_BHTT = q @ k_BHTK.to(softmax_dtype).transpose(-2, -1)
        if mask_B1TT is None:
            mask_B1TT = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        scores_BHTT = scores_BHTT.masked_fill(~mask_B1TT, float("-inf"))
        weights_BHTT = scores_BHTT.softmax(dim=-1)
    weights_BHTT = F.dropout(weights_BHTT.to(v_BHTK.dtype), p=dropout_p, training=dropout_p > 0)
    return weights_BHTT @ v_BHTK


class LayerNorm(nn.LayerNorm):
    """A LayerNorm that runs in 16 bits when its input and weights are 16-bit (bf16-pure, or
    FSDP's 16-bit gathers), its statistics in fp32 inside the kernel. Under autocast, CUDA would
    otherwise run it on an fp32 copy of the input, save that copy for backward and cast the fp32
    output back to 16 bits for every projection after it: GPT-2 124M, bf16-pure, batch 8 x 1024
    on an H200 held 0.6 GiB of such copies in 4.3 (plan/cuda_autocast.py). The CPU's autocast
    leaves it in 16 bits already, so on a CPU nothing changes; with fp32 weights (bf16 autocast)
    it takes the fp32 path as before."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sixteen_bit = x.dtype in (torch.bfloat16, torch.float16)
        weights_too = self.weight is not None and self.weight.dtype == x.dtype
        if sixteen_bit and weights_too and torch.is_autocast_enabled(x.device.type):
            with torch.autocast(x.device.type, enabled=False):
                return super().forward(x)
        return super().forward(x)


class Attention(nn.Module):
    """Residual branch: LayerNorm -> causal self-attention -> projection -> dropout.

    Queries, keys and values have a projection each (as torchtitan's and Hugging Face's Llama
    do): tensor parallelism splits each column-wise by heads, and a checkpoint reads the same
    at every layout. GPT-2's fused `c_attn` (and this model's former `qkv`) is split on load
    (`split_fused_qkv`); one fused GEMM or three measured the same on a CPU.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.impl = cfg.attention
        self.softmax_dtype = _DTYPES[cfg.softmax_dtype]
        self.norm = LayerNorm(cfg.d_model, bias=cfg.bias)
        self.q = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.k = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.v = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.document_mask: torch.Tensor | None = None
        """[B, 1, T, T]: packed documents attend only within themselves (GPT.use_positions)."""

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        K = x_BTD.shape[-1] // self.n_head
        h_BTD = self.norm(x_BTD)
        B, T = h_BTD.shape[:2]  # under sequence parallelism x holds 1/tp of T, h all of it
        # -1: the heads this process computes (all of them, but 1/tp under tensor parallelism)
        q_BHTK, k_BHTK, v_BHTK = (
            proj(h_BTD).view(B, T, -1, K).transpose(1, 2) for proj in (self.q, self.k, self.v)
        )
        p = self.dropout if self.training else 0.0
        mask = self.document_mask
        sdpa = {"dropout_p": p, "is_causal": mask is None, "attn_mask": mask}
        if self.impl in ("sdpa", "auto"):  # auto unresolved (no device yet): sdpa
            y_BHTK = F.scaled_dot_product_attention(q_BHTK, k_BHTK, v_BHTK, **sdpa)
        elif self.impl in SDPA_BACKENDS:
            with sdpa_kernel(SDPA_BACKENDS[self.impl]):
                y_BHTK = F.scaled_dot_product_attention(q_BHTK, k_BHTK, v_BHTK, **sdpa)
        elif self.impl == "blocked":  # no dropout (config checks)
            y_BHTK = blocked_attention(q_BHTK, k_BHTK, v_BHTK, mask)
        else:
            y_BHTK = plain_attention(
                q_BHTK,
                k_BHTK,
                v_BHTK,
                dropout_p=p,
                softmax_dtype=self.softmax_dtype,
                mask_B1TT=mask,
            )
        y_BTD = y_BHTK.transpose(1, 2).reshape(B, T, -1)
        return self.resid_dropout(self.proj(y_BTD))


def tanh_gelu_sigmoid_form(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's GELU written as x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3), in fp32
    and cast back: the same function (1 + tanh(u) = 2 sigmoid(2u)), for inductor to fuse."""
    x32 = x.float()
    u2 = (2 * math.sqrt(2 / math.pi)) * (x32 + 0.044715 * x32 * x32 * x32)
    return (x32 * torch.sigmoid(u2)).to(x.dtype)


class TanhGELU(nn.GELU):
    """GPT-2's GELU (tanh approximation). Compiled, it is written in its sigmoid form
    (`tanh_gelu_sigmoid_form`): inductor's vectorised tanh on CPUs is slow (forward + backward
    14.9 ms vs 7.0 ms this way at B's 4,096 x 1,536 in bf16, 2 Zen 4 cores). Eager, it runs
    torch's own GELU kernel, or `kernel` where one is set (`train.gelu_kernel`,
    techniques/gelu_kernel.py)."""

    def __init__(self) -> None:
        super().__init__(approximate="tanh")
        self.kernel: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return tanh_gelu_sigmoid_form(x)
        if self.kernel is not None:
            return self.kernel(x)
        return super().forward(x)


class MLP(nn.Module):
    """Residual branch: LayerNorm -> Linear -> GELU (tanh, as GPT-2) -> Linear -> dropout."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        F_ = cfg.mlp_ratio * cfg.d_model
        self.norm = LayerNorm(cfg.d_model, bias=cfg.bias)
        self.fc = nn.Linear(cfg.d_model, F_, bias=cfg.bias)
        self.act = TanhGELU()
        self.proj = nn.Linear(F_, cfg.d_model, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.resid_dropout(self.proj(self.act(self.fc(self.norm(x_BTD)))))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_BTD = x_BTD + self.attn(x_BTD)
        return x_BTD + self.mlp(x_BTD)


class GPT(nn.Module):
    """onegpu's GPT-2-style decoder; declares models.protocol.LanguageModel."""

    is_classifier = False
    logit_transform = None  # logits are the output layer's, unchanged

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.vocab_size = cfg.vocab_size
        self.padded_vocab = padded_vocab(cfg)
        self.last_auxiliary: torch.Tensor | None = None  # dense: no auxiliary term
        self.positions_BT: torch.Tensor | None = None  # packed rows' (use_positions)
        self.wte = nn.Embedding(self.padded_vocab, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm_f = LayerNorm(cfg.d_model, bias=cfg.bias)
        # GPT-2's output layer has no bias; an untied one may (Lippe's tutorial).
        self.lm_head = nn.Linear(cfg.d_model, self.padded_vocab, bias=cfg.head_bias)
        self.tie_weights()
        self.register_load_state_dict_pre_hook(_split_fused_qkv_on_load)

    def tie_weights(self) -> None:
        """Share wte and lm_head (again after to_empty(), which may replace parameters)."""
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 initialisation: N(0, std) for weights, residual projections scaled by
        1/sqrt(2 * n_layer), zero biases, unit LayerNorm gains."""
        self.tie_weights()
        std = self.cfg.init_std
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                is_residual_out = name.endswith("attn.proj") or name.endswith("mlp.proj")
                s = std / math.sqrt(2 * self.cfg.n_layer) if is_residual_out else std
                if not (module is self.lm_head and self.cfg.tie_embeddings):
                    nn.init.normal_(module.weight, mean=0.0, std=s)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        self.wte.weight[self.vocab_size :].zero_()  # padding rows: never read, never trained
        if not self.cfg.tie_embeddings:
            self.lm_head.weight[self.vocab_size :].zero_()

    def use_positions(self, positions_BT: torch.Tensor | None) -> None:
        """The next forwards' rows hold documents with these positions (models/documents.py):
        position embeddings from them, attention within each document. None: one a row."""
        mask = None if positions_BT is None else document_mask(positions_BT)
        self.positions_BT = positions_BT
        for module in self.modules():
            if isinstance(module, Attention):
                module.document_mask = mask

    def embed(self, idx_BT: torch.Tensor) -> torch.Tensor:
        """Token plus position embeddings (dropped out): the residual stream's start."""
        if self.positions_BT is not None:
            return self.drop(self.wte(idx_BT) + self.wpe(self.positions_BT))
        pos_T = torch.arange(idx_BT.shape[1], device=idx_BT.device)
        return self.drop(self.wte(idx_BT) + self.wpe(pos_T))

    def hidden(self, idx_BT: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states; the loss applies the output layer (maybe in chunks)."""
        x_BTD = self.embed(idx_BT)
        for block in self.blocks:
            x_BTD = block(x_BTD)
        return self.norm_f(x_BTD)

    def output(self, h_BTD: torch.Tensor, *, in_place: bool = True) -> torch.Tensor:
        """Logits over the padded vocabulary from final-normed hidden states, the padding
        masked to -inf (softmax gives them exactly 0, so loss and gradients are those of the
        unpadded model). `in_place` false: into a new tensor (a pipeline stage's output must
        stay the tensor the layer made)."""
        logits_BTV = self.lm_head(h_BTD)
        # (a vocabulary-parallel output layer masks its own shard: tensor_parallel.py)
        if self.padded_vocab > self.vocab_size and not getattr(self.lm_head, "masks_padding", 0):
            if not in_place:
                padding_V = torch.arange(self.padded_vocab, device=h_BTD.device) >= self.vocab_size
                return logits_BTV.masked_fill(padding_V, float("-inf"))
            logits_BTV[..., self.vocab_size :] = float("-inf")
        return logits_BTV

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        return self.output(self.hidden(idx_BT))

    def stage(self, x: torch.Tensor, blocks: range, first: bool, last: bool) -> torch.Tensor:
        """A pipeline stage's part of the forward: token ids (`first`) or the residual stream
        through `blocks` to the residual stream, or (`last`) to the logits. One method of the
        root, so FSDP gathers the root's weights before any block runs."""
        if first:
            x = self.embed(x)
        for i in blocks:
            x = self.blocks._modules[str(i)](x)
        return self.output(self.norm_f(x), in_place=False) if last else x

    def auxiliary_loss(self) -> torch.Tensor | None:
        return None  # dense: no auxiliary term

    def padding_params(self) -> int:
        """Parameters that only pad the vocabulary (counted in no model size)."""
        rows = self.padded_vocab - self.vocab_size
        untied_head = (
            0
            if self.cfg.tie_embeddings
            else rows * (self.cfg.d_model + (self.lm_head.bias is not None))
        )
        return rows * self.cfg.d_model + untied_head


def _split_fused_qkv_on_load(module: nn.Module, state: dict, prefix: str, *args, **kwargs) -> None:
    """load_state_dict reads a fused `qkv` (a checkpoint of this model before the split)."""
    fused = [k for k in state if k.startswith(prefix) and ".attn.qkv." in k]
    if fused:
        split = split_fused_qkv({k: state.pop(k) for k in fused})
        state.update(split)


def count_params(model: nn.Module) -> int:
    """Unique parameters (a tied weight counts once), vocabulary padding left out."""
    return sum(p.numel() for p in model.parameters()) - model.padding_params()
