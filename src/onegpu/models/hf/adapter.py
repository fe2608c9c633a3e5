"""`HFModel`: a transformers model seen as onegpu sees its GPT (models/protocol.py).

Nothing here is written per architecture. The model is found through transformers' own generic
accessors: the decoder (`get_decoder()`), the output head (`get_output_embeddings()`) and the
repeated blocks (the `nn.ModuleList` whose modules are of a class named in `_no_split_modules`,
the unit transformers itself never splits across devices).

Loading follows the build's order: the architecture is built on the meta device from
`config.json` (no memory), the techniques wrap it, then it is materialised on the device,
initialised by transformers' own `_init_weights` (rotary tables included), and overwritten by
the folder's safetensors weights when there are any.
"""

from __future__ import annotations

import copy
import sys

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from onegpu.config import ConfigError, ModelConfig
from onegpu.models.documents import document_ids
from onegpu.models.hf.folder import HFFolder, open_hf_folder, require_transformers
from onegpu.models.hf.patches import around_forward, experts_in_compute_dtype_always
from onegpu.models.hf.translate import attn_implementation, config_logit_transform
from onegpu.models.hf.weights import load_safetensors_into


def find_blocks(model: nn.Module) -> nn.ModuleList:
    """The repeated transformer blocks: the ModuleList of `_no_split_modules` classes."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if (
            isinstance(module, nn.ModuleList)
            and len(module)
            and all(type(b).__name__ in names for b in module)
        ):
            return module
    for module in model.modules():  # no declared block class: the longest list of equal blocks
        if (
            isinstance(module, nn.ModuleList)
            and len(module)
            and len({type(b) for b in module}) == 1
        ):
            return module
    raise ConfigError(
        "model.hf",
        f"cannot find the transformer blocks of {type(model).__name__} (no ModuleList of "
        "its _no_split_modules); this architecture is not supported",
    )


class HFModel(nn.Module):
    """A transformers model seen as onegpu sees its GPT. State-dict keys are the model's own
    under `hf.` (export strips it)."""

    def __init__(self, hf: nn.Module, cfg: ModelConfig, folder: HFFolder):
        super().__init__()
        self.hf = hf
        self.cfg = cfg
        self.folder = folder
        self.head = folder.head
        self.is_classifier = folder.head == "sequence-classification"
        self.logit_transform = config_logit_transform(hf.config)
        out = self.output_layer()
        self.vocab_size = out.out_features if self.is_classifier else cfg.vocab_size
        self.padded_vocab = self.vocab_size
        # not registered as submodules: they are parts of self.hf (no duplicate state keys)
        object.__setattr__(self, "_blocks", find_blocks(hf))
        experts_in_compute_dtype_always(hf)  # a checkpoint's recompute included
        self._balancing = router_balancing(hf)
        self._aux: torch.Tensor | None = None
        self.last_auxiliary: torch.Tensor | None = None
        """The last training forward's term (detached), for the log line."""
        self.positions_BT: torch.Tensor | None = None
        """Packed rows' positions (use_positions), passed on as `position_ids`."""
        self.documents_BT: torch.Tensor | None = None
        """Their document ids: transformers' packed-sequence check answered with them."""

    @property
    def blocks(self) -> nn.ModuleList:
        return self._blocks

    def output_layer(self) -> nn.Module:
        if self.is_classifier:
            return _classifier_out(self.hf)
        return self.hf.get_output_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        return self.output_layer()

    def hidden(self, idx_BT: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states of the decoder (the head is applied by the loss)."""
        decoder = self.hf.get_decoder()
        with around_forward(self.documents_BT):
            out = decoder(input_ids=idx_BT, use_cache=False, **self._forward_kwargs())
        self._keep_aux(out)
        return out.last_hidden_state

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        """Logits: [B, T, V] for a causal LM, [B, classes] for a classifier."""
        kwargs = {} if self.is_classifier else {"use_cache": False, **self._forward_kwargs()}
        with around_forward(self.documents_BT):
            out = self.hf(input_ids=idx_BT, **kwargs)
        self._keep_aux(out)
        return out.logits

    def use_positions(self, positions_BT: torch.Tensor | None) -> None:
        """The next forwards' rows hold documents with these positions (models/documents.py):
        transformers takes packed documents with `position_ids` and no attention mask, and
        builds the block-diagonal mask for its attention kernels itself."""
        self.positions_BT = positions_BT
        self.documents_BT = None if positions_BT is None else document_ids(positions_BT)

    def _forward_kwargs(self) -> dict[str, object]:
        kwargs: dict[str, object] = {"output_router_logits": True} if self._balancing else {}
        if self.positions_BT is not None:
            kwargs["position_ids"] = self.positions_BT
        return kwargs

    def _keep_aux(self, out) -> None:
        if self._balancing is not None:
            self._aux = self._balancing(out.router_logits)

    def auxiliary_loss(self) -> torch.Tensor | None:
        aux, self._aux = self._aux, None
        if aux is not None and self.training:
            self.last_auxiliary = aux.detach()
        return aux

    def padding_params(self) -> int:
        return 0

    def tie_weights(self) -> None:
        self.hf.tie_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """transformers' own initialisation (it also fills rotary tables and other buffers),
        then the folder's weights if it has any."""
        for module in self.hf.modules():  # built on meta: nothing is initialised yet
            module.__dict__.pop("_is_hf_initialized", None)
        for p in self.hf.parameters():
            p.__dict__.pop("_is_hf_initialized", None)
        if hasattr(self.hf, "initialize_weights"):
            self.hf.initialize_weights()
        else:  # pragma: no cover - transformers 4.x
            self.hf.apply(self.hf._init_weights)
            _init_rotary_v4(self.hf)
        self.hf.tie_weights()
        fake = any(is_fake(p) for p in self.hf.parameters())  # a plan reads no weights
        if self.folder.weights and not fake:
            load_safetensors_into(self.hf, self.folder.weights)


def router_balancing(hf: nn.Module):
    """For a mixture of experts whose config turns the router's outputs on
    (`output_router_logits`, as Mixtral, Qwen-MoE and DeepSeek configs may): router logits ->
    `router_aux_loss_coef` x the model's own load-balancing loss (its module's
    `load_balancing_loss_func`, what its `labels=` loss adds). None otherwise."""
    config = hf.config
    coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    if not getattr(config, "output_router_logits", False) or not coef:
        return None
    func = getattr(sys.modules[type(hf).__module__], "load_balancing_loss_func", None)
    experts = getattr(hf, "num_experts", None) or getattr(config, "num_local_experts", None)
    top_k = getattr(hf, "num_experts_per_tok", None) or getattr(config, "num_experts_per_tok", 2)
    if func is None or not experts:
        raise ConfigError(
            "model.hf",
            f"{type(hf).__name__} asks for its router loss "
            "(output_router_logits) but transformers offers no balancing loss for "
            "it here; set output_router_logits false in config.json",
        )

    def balancing(router_logits) -> torch.Tensor:
        return coef * func(router_logits, experts, top_k, None)

    return balancing


def _classifier_out(hf: nn.Module) -> nn.Module:
    for name in ("score", "classifier", "cls"):
        out = getattr(hf, name, None)
        while out is not None and not isinstance(out, nn.Linear):
            out = getattr(out, "out_proj", None) or getattr(out, "dense", None)
        if isinstance(out, nn.Linear):
            return out
    raise ConfigError("model.hf", f"cannot find the classification layer of {type(hf).__name__}")


def _init_rotary_v4(hf: nn.Module) -> None:  # pragma: no cover - transformers 4.x
    for m in hf.modules():
        if hasattr(m, "rope_init_fn") and hasattr(m, "inv_freq"):
            inv, _ = m.rope_init_fn(m.config, m.inv_freq.device)
            m.inv_freq.copy_(inv)
            if hasattr(m, "original_inv_freq"):
                m.original_inv_freq = m.inv_freq


def build_hf_model(cfg: ModelConfig) -> HFModel:
    """The folder's architecture, built under the caller's device context (meta for a real
    build, fake CPU for a plan), in fp32, not yet initialised."""
    folder = open_hf_folder(cfg.hf, cfg.hf_head)
    transformers = require_transformers()
    config = copy.deepcopy(folder.config)  # the folder's is cached and shared: never changed
    config.use_cache = False
    auto = (
        transformers.AutoModelForSequenceClassification
        if folder.head == "sequence-classification"
        else transformers.AutoModelForCausalLM
    )
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    try:
        hf = auto.from_config(
            config,
            attn_implementation=attn_implementation(cfg.attention),
            **{dtype_kw: torch.float32},
        )
    except ValueError as e:
        reason = str(e).splitlines()[0]
        if "attention implementation" in reason:
            raise ConfigError(
                "model.attention",
                f"{type(config).__name__}'s transformers class has no SDPA attention; use "
                "--model.attention plain (transformers' eager attention) or auto",
            ) from None
        raise ConfigError(
            "model.hf", f"{folder.path}: {reason} (is it a {folder.head} model?)"
        ) from None
    model = HFModel(hf, cfg, folder)
    check_head(model)
    return model


_HEAD_BIAS: dict[tuple[str, str], bool] = {}


def hf_head_bias(cfg: ModelConfig) -> bool:
    """Whether the folder's output layer has a bias (Phi's has; the fused loss kernels take
    none), read from its architecture built on the meta device: nothing is allocated, and
    config.json has no field that says it for every architecture. Once per folder."""
    key = (cfg.hf, cfg.hf_head)
    if key not in _HEAD_BIAS:
        with torch.device("meta"):
            _HEAD_BIAS[key] = build_hf_model(cfg).output_layer().bias is not None
    return _HEAD_BIAS[key]


def check_head(model: HFModel) -> None:
    """Refuse output layers the loss cannot use."""
    out = model.output_layer()
    if not isinstance(out, nn.Linear):
        raise ConfigError(
            "model.hf",
            f"the output layer of {type(model.hf).__name__} is a {type(out).__name__}, not a "
            "linear layer; onegpu's losses need a linear head",
        )
