"""The same model at another depth or width: what fast planning (two shallow copies, extrapolated
in depth) and `onegpu plan --largest` (a ladder of sizes of one family) are built on.

A shape is the handful of numbers that set a decoder's size. For onegpu's GPT they are
[model] fields; for a model.hf folder they are its config.json's, so a reshaped folder is
written (config.json only: an architecture, no weights) under the cache and planned like any
other. Everything else of the configuration is kept (its per-layer lists at the new depth).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

from onegpu.cache import cache_root, writing
from onegpu.config import Config, ModelConfig


@dataclass(frozen=True)
class Shape:
    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int  # = n_head where the model has no grouped-query attention
    d_ff: int  # the MLP's hidden width

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def label(self) -> str:
        kv = f" ({self.n_kv_head} kv)" if self.n_kv_head != self.n_head else ""
        return (
            f"{self.n_layer} layers x d_model {self.d_model}, {self.n_head} heads{kv}, "
            f"MLP {self.d_ff}"
        )


def _hf_config(m: ModelConfig):
    from onegpu.models.hf.folder import open_hf_folder

    return open_hf_folder(m.hf, m.hf_head).config


def shape_of(cfg: Config) -> Shape:
    """The shape `cfg` trains."""
    if not cfg.model.hf:
        m = cfg.model
        return Shape(m.n_layer, m.d_model, m.n_head, m.n_head, m.mlp_ratio * m.d_model)
    c = _hf_config(cfg.model)
    c = c.get_text_config() if hasattr(c, "get_text_config") else c
    d, heads = int(c.hidden_size), int(c.num_attention_heads)
    kv = int(getattr(c, "num_key_value_heads", None) or heads)
    d_ff = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * d
    return Shape(int(c.num_hidden_layers), d, heads, kv, int(d_ff))


def block_pattern(cfg: Config) -> tuple[int, int]:
    """How the blocks repeat: the leading blocks built unlike the rest (DeepSeek's first
    `first_k_dense_replace` layers and Qwen-MoE's leading `mlp_only_layers` have a dense MLP
    instead of experts) and the period of the rest (Qwen-MoE's experts in every
    `decoder_sparse_step`-th block). onegpu's GPT: (0, 1)."""
    if not cfg.model.hf:
        return 0, 1
    c = _hf_config(cfg.model)
    c = c.get_text_config() if hasattr(c, "get_text_config") else c
    lead = int(getattr(c, "first_k_dense_replace", 0) or 0)
    dense = set(getattr(c, "mlp_only_layers", None) or ())
    while lead in dense:
        lead += 1
    return lead, max(1, int(getattr(c, "decoder_sparse_step", 1) or 1))


def with_shape(cfg: Config, shape: Shape) -> Config:
    """`cfg` training a model of `shape` (a model.hf folder: a reshaped copy of its config.json
    under the cache, keyed by its content)."""
    old = shape_of(cfg)
    if shape == old:
        return cfg
    if not cfg.model.hf:
        if shape.d_ff % shape.d_model or shape.n_kv_head != shape.n_head:
            raise ValueError(f"onegpu's GPT has no shape {shape}: MLP width a multiple of d_model")
        m = dataclasses.replace(
            cfg.model,
            n_layer=shape.n_layer,
            d_model=shape.d_model,
            n_head=shape.n_head,
            mlp_ratio=shape.d_ff // shape.d_model,
        )
        return dataclasses.replace(cfg, model=m)
    config = _hf_config(cfg.model)
    values = config.to_dict()
    text = values.get("text_config") if isinstance(values.get("text_config"), dict) else values
    for key, value in _hf_keys(config, shape).items():
        text[key] = value
    _fit_layer_lists(text, old.n_layer, shape.n_layer)
    if text.get("head_dim") and shape.head_dim != old.head_dim:
        # only a new head size: a config's own head_dim need not be width / heads (Gemma-2's
        # 256 at 2304 / 8; DeepSeek's is its rotary part), and a copy in depth keeps it
        text["head_dim"] = shape.head_dim
    blob = json.dumps(values, sort_keys=True, default=str)
    folder = cache_root() / "shapes" / hashlib.sha256(blob.encode()).hexdigest()[:16]
    if not (folder / "config.json").is_file():
        with writing():
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / "config.json.tmp"
            tmp.write_text(blob)
            tmp.replace(folder / "config.json")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf=str(folder)))


LAYER_NUMBER_LISTS = ("mlp_only_layers",)
"""config.json lists of layer numbers (Qwen-MoE's dense layers), not one entry per layer."""


def _fit_layer_lists(text: dict, depth: int, n_layer: int) -> None:
    """config.json's per-layer lists at the copy's depth: transformers checks them against
    num_hidden_layers (`layer_types` of Gemma-2, Qwen2-MoE, ...; a copy keeping 26 entries for 2
    blocks is refused), and the model builds each block from its entry. A list of one entry per
    layer is cut to the copy's first `n_layer` (repeated from the start where the copy is
    deeper: the pattern goes on); a list of layer numbers keeps those the copy has."""
    if depth == n_layer:
        return
    for key, value in text.items():
        if not isinstance(value, list) or key == "architectures":
            continue
        if key in LAYER_NUMBER_LISTS:
            text[key] = [i for i in value if not isinstance(i, int) or i < n_layer]
        elif depth > 1 and len(value) == depth:
            text[key] = [value[i % depth] for i in range(n_layer)]


def _hf_keys(config, shape: Shape) -> dict[str, int]:
    """config.json's own names for the shape's numbers (GPT-2's n_layer, Llama's
    num_hidden_layers, ...: transformers maps the common names to them)."""
    amap = getattr(config, "attribute_map", {}) or {}
    out = {
        amap.get("num_hidden_layers", "num_hidden_layers"): shape.n_layer,
        amap.get("hidden_size", "hidden_size"): shape.d_model,
        amap.get("num_attention_heads", "num_attention_heads"): shape.n_head,
    }
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "num_key_value_heads", None):
        out["num_key_value_heads"] = shape.n_kv_head
    if getattr(text, "intermediate_size", None):
        out["intermediate_size"] = shape.d_ff
    elif hasattr(text, "n_inner"):
        out["n_inner"] = shape.d_ff
    return out


def with_depth(cfg: Config, n_layer: int) -> Config:
    """`cfg` with `n_layer` blocks, everything else as it is."""
    return with_shape(cfg, dataclasses.replace(shape_of(cfg), n_layer=n_layer))


def scaled(base: Shape, factor: float) -> Shape:
    """`base` grown (or shrunk) in width by `factor`, depth in proportion, as decoder families
    grow (Llama 3: 2048 x 16 layers at 1B, 3072 x 28 at 3B, 4096 x 32 at 8B, 8192 x 80 at
    70B; the width-to-depth ratio stays near 100-130, 8 kv heads throughout): the head size,
    the number of kv heads and the MLP's ratio are kept, widths rounded to whole kv groups
    (and a non-integer MLP ratio to 256)."""
    if base.n_kv_head != base.n_head:  # grouped queries: Llama keeps 8 kv heads at every size
        kv = base.n_kv_head
        heads = max(kv, round(base.n_head * factor / kv) * kv)
    else:
        heads = kv = max(1, round(base.n_head * factor))
    d_model = heads * base.head_dim
    n_layer = max(1, round(base.n_layer * factor))
    if base.d_ff % base.d_model == 0:  # an integer MLP ratio (GPT-2's 4) stays exact
        d_ff = d_model * (base.d_ff // base.d_model)
    else:
        d_ff = max(256, round(d_model * base.d_ff / base.d_model / 256) * 256)
    return Shape(n_layer, d_model, heads, kv, d_ff)


def ladder(base: Shape, down: int = 8, up: int = 12, step: float = 2 ** (1 / 4)) -> list[Shape]:
    """Shapes of `base`'s family from small to large, `step` apart in width (x1.19 in width and
    depth: about x1.7 in parameters), `base` itself included, duplicates dropped."""
    out: list[Shape] = []
    for k in range(-down, up + 1):
        s = base if k == 0 else scaled(base, step**k)
        if s not in out and s.n_layer >= 1:
            out.append(s)
    return out
