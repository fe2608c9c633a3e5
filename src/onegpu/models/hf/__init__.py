"""Hugging Face `transformers` models as onegpu models: any causal LM (and encoder classifiers)
from a local folder, through the same build, techniques and step as our GPT.

- folder.py: what a local folder holds (config, weights, tokenizer); packaged configurations
- translate.py: its config.json as [model] fields; what its architecture allows
- adapter.py: `HFModel`, the model behind onegpu's model protocol; `build_hf_model`
- weights.py: the folder's safetensors into the built model
- patches.py: the one workaround applied to transformers, isolated and tested
"""

from onegpu.models.hf.adapter import (
    HFModel,
    build_hf_model,
    check_head,
    find_blocks,
    hf_head_bias,
)
from onegpu.models.hf.folder import (
    HFFolder,
    folder_eos_id,
    open_hf_folder,
    packaged_models,
    require_transformers,
)
from onegpu.models.hf.translate import chunkable_loss, default_attention, resolve_model_config
from onegpu.models.hf.weights import load_safetensors_into

__all__ = [
    "HFFolder",
    "HFModel",
    "build_hf_model",
    "check_head",
    "chunkable_loss",
    "default_attention",
    "find_blocks",
    "folder_eos_id",
    "hf_head_bias",
    "load_safetensors_into",
    "open_hf_folder",
    "packaged_models",
    "require_transformers",
    "resolve_model_config",
]
