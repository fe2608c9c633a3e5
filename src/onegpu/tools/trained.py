"""A trained model back from a run folder (or a Hugging Face model folder), in fp32 on the CPU
or a given device, for `onegpu export` and `onegpu generate`. No technique is applied: the
plain architecture with the trained weights."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from onegpu.backends.torch import checkpoint as ckpt
from onegpu.backends.torch.build import make_model, materialize, resolve
from onegpu.config import Config, ConfigError, load_config, with_overrides
from onegpu.data.tokenizer import ByteTokenizer, FileTokenizer, Tokenizer
from onegpu.models.hf import folder_eos_id, open_hf_folder
from onegpu.models.protocol import LanguageModel
from onegpu.runs import checkpoints


@dataclass
class Trained:
    cfg: Config  # resolved: every model field filled in
    model: LanguageModel
    tokenizer: Tokenizer | None
    source: Path
    weights: str  # where the weights came from


def load_trained(path: str | Path, device: torch.device | None = None) -> Trained:
    """The model of a run folder (its final model.safetensors, else its newest checkpoint)
    or of a Hugging Face folder (its own weights)."""
    device = device or torch.device("cpu")
    source = Path(path).expanduser()
    if (source / "config.toml").is_file():
        return _from_run(source, device)
    if (source / "config.json").is_file():
        return _from_hf_folder(source, device)
    raise ConfigError(
        "RUN_DIR",
        f"{str(path)!r} is neither a run folder (config.toml) nor a Hugging Face model folder "
        "(config.json)",
    )


def _plain(cfg: Config, device: torch.device) -> tuple[Config, LanguageModel]:
    """The run's model for forwards in this one process: resolved without the training
    layout (tensor parallelism, compile, checkpointing), which its kernels need not follow."""
    if cfg.model.attention == "auto" and not cfg.model.hf:  # no timing for a few forwards
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention="sdpa"))
    alone = dataclasses.replace(
        cfg,
        dist=dataclasses.replace(cfg.dist, tp=1),
        train=dataclasses.replace(cfg.train, compile="none"),
        memory=dataclasses.replace(cfg.memory, checkpointing="none"),
    )
    cfg = resolve(alone, device).config
    with torch.device("meta"):
        model = make_model(cfg.model)
    model = materialize(model, device, seed=cfg.train.seed, dtype=torch.float32)
    return cfg, model.eval()


def _from_run(run: Path, device: torch.device) -> Trained:
    cfg = load_config(file=run / "config.toml", overrides={"train.device": device.type})
    if cfg.model.hf:  # the run's own copy of the folder's config: the folder may be gone
        if not (run / "model" / "config.json").is_file():
            raise ConfigError("RUN_DIR", f"{run}/model/config.json is missing")
        cfg = with_overrides(cfg, {"model.hf": str(run / "model")})
    cfg, model = _plain(cfg, device)
    final = run / "model.safetensors"
    if final.is_file():
        from safetensors.torch import load_model

        load_model(model, str(final), strict=True, device=str(device))
        weights = str(final)
    else:
        found = checkpoints.complete_checkpoints(run / "checkpoints")
        if not found:
            raise ConfigError(
                "RUN_DIR", f"{run} has no model.safetensors and no complete checkpoint"
            )
        newest = ckpt.load(found[-1][1], field="RUN_DIR")
        if newest.sharded:  # written by several processes: read the whole tensors from DCP
            from onegpu.distributed.dcp import load_model

            load_model(newest.path, model)
        else:
            model.load_state_dict({k: v.float() for k, v in newest.state["model"].items()})
        weights = str(newest.path)
    model.tie_weights()
    return Trained(cfg, model, _run_tokenizer(run), run, weights)


def _run_tokenizer(run: Path) -> Tokenizer | None:
    path = run / "tokenizer.json"
    if not path.is_file():
        return None
    eot = run / "tokenizer_eot.txt"
    tok = FileTokenizer(path, int(eot.read_text()) if eot.is_file() else None)
    if tok.vocab_size == 256:  # our byte tokenizer: decode exactly as in training
        return ByteTokenizer()
    return tok


def _from_hf_folder(folder: Path, device: torch.device) -> Trained:
    cfg = load_config(
        overrides={"model.hf": str(folder), "train.device": device.type, "model.seq_len": "1"}
    )
    limit = open_hf_folder(str(folder)).max_positions or 2048
    cfg = with_overrides(cfg, {"model.seq_len": str(limit)})
    cfg, model = _plain(cfg, device)
    hf = open_hf_folder(str(folder))
    tok = None
    if hf.tokenizer is not None:
        tok = FileTokenizer(hf.tokenizer, folder_eos_id(hf))
    weights = str(hf.weights[0]) if hf.weights else "none (initialised from config.json)"
    return Trained(cfg, model, tok, folder, weights)
