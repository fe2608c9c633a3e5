"""Every option of onegpu, in one typed place: dataclasses, presets, TOML files, overrides.

Precedence is preset < TOML file < command line. Validation happens before anything runs or is
written, and raises `ConfigError` naming the field and a fix. Pure data: the bottom layer.
`options.py` holds the sections, `loading.py` presets/TOML/overrides, `validation.py` the checks.
"""

from onegpu.config.checkpointing import (
    BLOCK_POLICIES,
    CHECKPOINTING_MODES,
    Checkpointing,
    parse_checkpointing,
    per_block_mode,
)
from onegpu.config.data_checks import check_data_sizes
from onegpu.config.loading import (
    all_fields,
    all_keys,
    apply_values,
    field_docs,
    load_config,
    load_toml,
    preset_names,
    preset_values,
    to_toml,
    type_name,
    with_overrides,
)
from onegpu.config.options import (
    HF_FIXED_FIELDS,
    LOW_RANK_OPTIMIZERS,
    SECTIONS,
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    DistConfig,
    MemoryConfig,
    ModelConfig,
    OptimConfig,
    OutConfig,
    TrainConfig,
    to_dict,
)
from onegpu.config.validation import (
    check_batch_split,
    check_distributed,
    resolve_strategy,
    validate,
)

__all__ = [
    "BLOCK_POLICIES",
    "CHECKPOINTING_MODES",
    "HF_FIXED_FIELDS",
    "LOW_RANK_OPTIMIZERS",
    "SECTIONS",
    "CheckpointConfig",
    "Checkpointing",
    "Config",
    "ConfigError",
    "DataConfig",
    "DistConfig",
    "MemoryConfig",
    "ModelConfig",
    "OptimConfig",
    "OutConfig",
    "TrainConfig",
    "all_fields",
    "check_batch_split",
    "check_data_sizes",
    "check_distributed",
    "resolve_strategy",
    "all_keys",
    "apply_values",
    "field_docs",
    "load_config",
    "load_toml",
    "parse_checkpointing",
    "per_block_mode",
    "preset_names",
    "preset_values",
    "to_dict",
    "to_toml",
    "type_name",
    "validate",
    "with_overrides",
]
