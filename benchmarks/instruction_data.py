"""Instruction and chat data on this CPU: what one example a row costs in padding against the
stream of windows and against packing (greedy, best-fit decreasing, each example isolated),
trained tokens/s beside all tokens/s, and what training on the answers only buys over training
on whole sequences.

Two sets, made here (nothing downloads): the tests' arithmetic instructions ("What is 123 plus
456?" -> "579.") and a chat set from the standard library (a user asks what a function does,
the assistant answers with the first line of its docstring). Each row is `onegpu train
--preset tiny` (2 x d64, byte-level, seq 128 or 256, batch 16) for the same steps in a fresh
process;
every row is scored by its model's loss on the validation split's answers (one example a row,
answers only: the same figure whatever the row trained on).

    python benchmarks/instruction_data.py [--steps 300]

Writes benchmarks/results/instruction-data-<date>.md (a new file each run).
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from records import bf16_kind, write_result

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "data"))
from instruction_sets import arithmetic_rows, write_jsonl  # noqa: E402

STDLIB_MODULES = ("json", "textwrap", "string", "shutil", "os.path", "functools", "itertools",
                  "collections", "re", "math", "statistics", "heapq", "bisect", "base64")  # fmt: skip
ROWS = {  # name: (backend, overrides)
    "stream, answers trained": ("torch", {"data.packing": "stream"}),
    "one a row, answers trained": ("torch", {"data.packing": "none"}),
    "one a row, whole sequence trained": (
        "torch",
        {"data.packing": "none", "data.train_on": "prompt+response"},
    ),
    "greedy-packed, answers trained": ("torch", {"data.packing": "greedy"}),
    "bfd-packed, answers trained": ("torch", {"data.packing": "bfd"}),
    "one a row, answers trained (JAX)": ("jax", {"data.packing": "none"}),
    "one a row, whole sequence trained (JAX)": (
        "jax",
        {"data.packing": "none", "data.train_on": "prompt+response"},
    ),
    "greedy-packed, answers trained (JAX)": ("jax", {"data.packing": "greedy"}),
    "bfd-packed, answers trained (JAX)": ("jax", {"data.packing": "bfd"}),
}
FIXED = {"train.batch_size": "16", "train.micro_batch_size": "16", "train.eval_every": "50",
         "train.log_every": "10", "optim.lr": "3e-3"}  # fmt: skip
SEQ_LEN = {"arithmetic": 128, "stdlib chat": 256}  # the longest example fits, a few pack


def stdlib_chats() -> list[dict]:
    """A user asks what a standard-library function does; the docstring's first line answers."""
    import importlib

    rows = []
    for name in STDLIB_MODULES:
        module = importlib.import_module(name)
        for attr, obj in sorted(vars(module).items()):
            doc = inspect.getdoc(obj) if callable(obj) and not attr.startswith("_") else None
            if not doc or not doc.splitlines()[0].strip():
                continue
            answer = doc.splitlines()[0].strip()[:120]
            question = f"What does {name}.{attr} do?"
            rows.append({"messages": [{"role": "user", "content": question},
                                      {"role": "assistant", "content": answer}]})  # fmt: skip
    return rows


def train(data: Path, backend: str, over: dict[str, str], steps: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "onegpu", "train", "--preset", "tiny", "--out", str(out),
           "--data.source", str(data), "--train.max_steps", str(steps),
           "--train.backend", backend, "--out.progress", "false"]  # fmt: skip
    for k, v in {**FIXED, **over}.items():
        cmd += [f"--{k}", v]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    summary = json.loads((out / "summary.json").read_text())
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    summary["val_curve"] = [(m["step"], m["val_loss"]) for m in metrics if "val_loss" in m]
    return summary


def answer_loss(run: Path, data: Path, seq_len: int) -> float:
    """The trained model's mean loss on the answers of the validation split (one example a
    row, answers only): the same figure for every row, however it trained."""
    from onegpu.config import DataConfig
    from onegpu.data.tokens import prepare_tokens
    from onegpu.techniques.loss import token_loss_sum
    from onegpu.tools.trained import load_trained

    answers = DataConfig(source=str(data), packing="none", train_on="response")
    rows = prepare_tokens(answers, 256).cut(answers, seq_len).val_rows
    model = load_trained(run).model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(len(rows)):
            x, y = (torch.from_numpy(a)[None] for a in rows.pair(i))
            total += float(token_loss_sum(model, x, y))
            count += int((y >= 0).sum())
    return total / count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as work:
        root = Path(work)
        sets = {
            "arithmetic": write_jsonl(root / "arithmetic.jsonl", arithmetic_rows(4000)),
            "stdlib chat": write_jsonl(root / "chat.jsonl", stdlib_chats()),
        }
        for set_name, path in sets.items():
            seq_len = SEQ_LEN[set_name]
            for name, (backend, over) in ROWS.items():
                out = root / f"{set_name}-{len(results)}"
                s = train(path, backend, {**over, "model.seq_len": str(seq_len)}, args.steps, out)
                results.append((set_name, name, s, answer_loss(out, path, seq_len)))
                print(f"{set_name} | {name}: {s['tokens_per_s']:,.0f} tok/s", flush=True)
    write(results, args.steps)


def write(results: list, steps: int) -> None:
    lines = [
        "# Instruction and chat data: rows, trained tokens, answers-only training (CPU)",
        "",
        f"Machine: {platform.processor() or platform.machine()}, bf16 kind: {bf16_kind()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}. `tiny` preset (2 x d64, "
        f"byte-level), seq {SEQ_LEN['arithmetic']} (arithmetic) and {SEQ_LEN['stdlib chat']} "
        f"(chat), batch 16, lr 3e-3, {steps} steps, precision auto. Packed rows hold several "
        "examples, each with positions from 0 and attending only within itself.",
        f"Command: `python benchmarks/instruction_data.py --steps {steps}`.",
        "",
        "| set | rows | tokens/s | trained tokens/s | trained tokens | padding | over-long | "
        "val loss (its own rows and masks) by step | loss on held-out answers |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for set_name, name, s, score in results:
        data = s["data"]
        curve = ", ".join(f"{step}: {v:.3f}" for step, v in s["val_curve"])
        padding = f"{data['padding']:.0%}" if "padding" in data else "0%"
        trained = s.get("trained_tokens_per_s")
        lines.append(
            f"| {set_name} | {name} | {s['tokens_per_s']:,.0f} | "
            f"{f'{trained:,.0f}' if trained else '-'} | {s.get('trained_tokens', 0):,} | "
            f"{padding} | "
            f"{data.get('overlong', 0)} of {data['counts']['train']['examples']:,} | {curve} | "
            f"{score:.3f} |"
        )
    write_result("instruction-data", lines)


if __name__ == "__main__":
    main()
