"""Packed rows against each example alone (fp32, CPU): the largest relative difference of an
example's loss and the largest absolute difference of its gradients, over every example of
every packed row, for onegpu's GPT and a tiny transformers Llama through onegpu's build, and
the same rows without isolation (the cross-talk packing would cause).

    python benchmarks/packing_parity.py

Writes benchmarks/results/packing-parity-<date>.md (a new file each run).
"""

from __future__ import annotations

import platform
import sys
import tempfile
from pathlib import Path

import torch
from records import bf16_kind, write_result

TESTS = Path(__file__).parents[1] / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "data")]
from conftest import hf_overrides, make_hf_config  # noqa: E402
from instruction_sets import arithmetic_rows, write_jsonl  # noqa: E402

from onegpu.backends.torch.build import build  # noqa: E402
from onegpu.config import DataConfig, load_config  # noqa: E402
from onegpu.data.tokens import prepare_tokens  # noqa: E402
from onegpu.data.windows import IGNORE_INDEX  # noqa: E402
from onegpu.models.documents import documents  # noqa: E402

T = 128
CASES = [("greedy", True), ("bfd", True), ("bfd", False)]


def _model(arch: str, llama: Path):
    over = {"model.seq_len": str(T), "train.device": "cpu", "train.precision": "fp32"}
    if arch == "llama":
        over = hf_overrides(llama, seq_len=T)
    cfg = load_config("tiny", overrides=over)
    return build(cfg, torch.device("cpu"), with_data=False).model.eval()


def _losses(model, x, y, positions, groups) -> list[torch.Tensor]:
    with documents(model, positions):
        out = model(x)
    logits = out.logits if hasattr(out, "logits") else out
    per_token = torch.nn.functional.cross_entropy(
        logits[0].float(), y[0], ignore_index=IGNORE_INDEX, reduction="none"
    )
    return [per_token[g].sum() for g in groups]


def _worst(model, rows, isolated: bool) -> tuple[float, float, int]:
    params = [p for p in model.parameters() if p.requires_grad]
    worst_loss = worst_grad = 0.0
    n = 0
    for r in range(len(rows)):
        x, y, pos = (torch.from_numpy(a)[None] for a in rows.row(r))
        examples = rows.packs[rows.offsets[r] : rows.offsets[r + 1]]
        groups, at = [], 0
        for e in examples:
            k = int(rows.spans[e][1] - rows.spans[e][0]) - 1
            groups.append(slice(at, at + k))
            at += k
        packed = _losses(model, x, y, pos if isolated else None, groups)
        for loss, g in zip(packed, groups, strict=True):
            own = _losses(model, x[:, g], y[:, g], None, [slice(None)])[0]
            worst_loss = max(worst_loss, abs(float(loss - own)) / abs(float(own)))
            a = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
            b = torch.autograd.grad(own, params, allow_unused=True)
            for ga, gb in zip(a, b, strict=True):
                if ga is not None and gb is not None:
                    worst_grad = max(worst_grad, float((ga - gb).abs().max()))
            n += 1
    return worst_loss, worst_grad, n


def main() -> None:
    import transformers

    lines = [
        "# Packed rows against each example alone (fp32, CPU)",
        "",
        f"Machine: {platform.processor() or platform.machine()}, bf16 kind: {bf16_kind()}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}. 40 arithmetic "
        f"instructions (the tests' generator), rows of {T}, answers trained. Command: "
        "`python benchmarks/packing_parity.py`.",
        "",
        "| model | packing | isolation | rows, examples | max rel. loss difference | "
        "max abs. gradient difference |",
        "|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as work:
        root = Path(work)
        source = write_jsonl(root / "pr.jsonl", arithmetic_rows(40))
        torch.manual_seed(1)
        llama = transformers.AutoModelForCausalLM.from_config(make_hf_config("llama"))
        llama.save_pretrained(root / "llama")
        for arch in ("gpt", "llama"):
            model = _model(arch, root / "llama")
            for packing, isolated in CASES:
                data = DataConfig(
                    source=str(source), cache_dir=str(root), val_fraction=0, packing=packing
                )
                rows = prepare_tokens(data, 256).cut(data, T).train_rows
                loss, grad, n = _worst(model, rows, isolated)
                label = "GPT" if arch == "gpt" else "Llama (transformers)"
                lines.append(
                    f"| {label} | {packing} | {'on' if isolated else 'off'} | {len(rows)}, {n} "
                    f"| {loss:.1e} | {grad:.1e} |"
                )
                print(lines[-1], flush=True)
    write_result("packing-parity", lines)


if __name__ == "__main__":
    main()
