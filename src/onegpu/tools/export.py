"""`onegpu export RUN_DIR --out FOLDER`: a run's weights as a Hugging Face model folder that
`AutoModelForCausalLM.from_pretrained(FOLDER)` loads: `config.json`, `model.safetensors` and the
tokenizer when the run had one.

A `--model.hf` run is written as its own architecture; onegpu's GPT as `GPT2LMHeadModel` (the
same architecture: models/convert.py). After writing, the folder is loaded back with
transformers and its logits are compared with the run's model on a random batch: the figure is
printed and returned, so every export states its own parity.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from onegpu.config import ConfigError
from onegpu.models.convert import gpt2_config_kwargs, hf_gpt2_state_dict
from onegpu.models.gpt import GPT
from onegpu.models.hf import HFModel, require_transformers
from onegpu.runs.atomic import recover, staging
from onegpu.runs.folder import CHAT_TEMPLATE, MODEL_FOLDER_FILES
from onegpu.tools.trained import Trained, load_trained


def export(run_dir: str | Path, out: str | Path, *, overwrite: bool = False) -> dict[str, Any]:
    """Write the folder; returns what was written and the parity figures. The folder is
    written beside `out` under a temporary name, checked, then renamed into place: a kill at
    any moment leaves the old folder or the new one, never a mix (folders.py)."""
    out = Path(out).expanduser().absolute()
    recover(out)  # a previous export killed between its two renames
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ConfigError("--out", f"{out} exists and is not empty; choose a new folder")
    require_transformers()  # imported quietly, or a clear error if it is missing
    trained = load_trained(run_dir)
    if isinstance(trained.model, HFModel):
        hf = _as_hf_model(trained)
    elif isinstance(trained.model, GPT):
        hf = _as_gpt2(trained)
    else:  # pragma: no cover - every model onegpu builds is one of the two
        raise ConfigError("RUN_DIR", f"cannot export a {type(trained.model).__name__}")
    with staging(out) as tmp:
        hf.save_pretrained(tmp, safe_serialization=True)
        tokenizer = _write_tokenizer(trained, tmp)
        parity = check_parity(trained, tmp)
    return {
        "out": str(out),
        "architecture": type(hf).__name__,
        "weights_from": trained.weights,
        "tokenizer": tokenizer,
        **parity,
    }


def _as_hf_model(trained: Trained) -> torch.nn.Module:
    """The run's transformers model itself, fp32, with the trained weights."""
    hf = trained.model.hf.float()
    _for_generation(hf, trained)
    return hf


def _for_generation(hf: torch.nn.Module, trained: Trained) -> None:
    """Training turned the KV cache off (config and generation_config); whoever loads the
    export generates: on again, and a pad token (the end-of-text one) so batches work."""
    hf.config.use_cache = True
    gen = getattr(hf, "generation_config", None)
    if gen is not None:
        gen.use_cache = True
        eos = gen.eos_token_id if gen.eos_token_id is not None else hf.config.eos_token_id
        if gen.pad_token_id is None and eos is not None:
            gen.pad_token_id = eos[0] if isinstance(eos, list) else eos


def _as_gpt2(trained: Trained) -> torch.nn.Module:
    import transformers

    tok = trained.tokenizer
    eos = tok.eot_id if tok is not None else None
    config = transformers.GPT2Config(**gpt2_config_kwargs(trained.model, eos_token_id=eos))
    hf = transformers.GPT2LMHeadModel(config)
    missing, unexpected = hf.load_state_dict(hf_gpt2_state_dict(trained.model), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:  # a bug in the converter, never the user's input
        raise RuntimeError(f"GPT-2 export: missing {missing}, unexpected {unexpected}")
    hf.tie_weights()
    _for_generation(hf, trained)
    return hf.eval()


def _write_tokenizer(trained: Trained, out: Path) -> str | None:
    """The model folder's own tokenizer files, else the run's data tokenizer as a
    PreTrainedTokenizerFast."""
    src = trained.source / "model"
    if (src / "tokenizer.json").is_file():
        for name in MODEL_FOLDER_FILES:
            if name.startswith(("tokenizer", "special", "chat")) and (src / name).is_file():
                shutil.copyfile(src / name, out / name)
        if (trained.source / CHAT_TEMPLATE).is_file():  # the template chat data trained with
            shutil.copyfile(trained.source / CHAT_TEMPLATE, out / CHAT_TEMPLATE)
        return "the model folder's"
    run_tok = trained.source / "tokenizer.json"
    if not run_tok.is_file():
        return None
    import transformers
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer.from_file(str(run_tok))
    eot = trained.tokenizer.eot_id if trained.tokenizer is not None else 0
    eot_token = tok.id_to_token(eot)
    fast = transformers.PreTrainedTokenizerFast(  # pad = end of text: batched pipelines run
        tokenizer_object=tok, eos_token=eot_token, bos_token=eot_token, pad_token=eot_token
    )
    chat = trained.source / CHAT_TEMPLATE
    if chat.is_file():  # trained on chat data: prompts render as training rendered them
        fast.chat_template = chat.read_text()
    fast.save_pretrained(out)
    return "the run's data tokenizer"


@torch.no_grad()
def check_parity(trained: Trained, folder: Path, *, batch: int = 2, seed: int = 0) -> dict:
    """Max |logit difference| between the run's model and the exported folder loaded back by
    transformers, in fp32, on random tokens."""
    import transformers

    auto = (
        transformers.AutoModelForSequenceClassification
        if trained.model.is_classifier
        else transformers.AutoModelForCausalLM
    )
    back = auto.from_pretrained(folder, local_files_only=True, dtype=torch.float32).eval()
    vocab = trained.cfg.model.vocab_size
    T = min(trained.cfg.model.seq_len, 64)
    idx = torch.randint(0, vocab, (batch, T), generator=torch.Generator().manual_seed(seed))
    ours = (
        trained.model(idx)[..., :vocab] if not trained.model.is_classifier else trained.model(idx)
    )
    theirs = back(input_ids=idx).logits
    diff = (ours - theirs).abs().max().item()
    return {"parity_max_abs_logit_diff": diff, "parity_logit_scale": ours.abs().max().item()}
