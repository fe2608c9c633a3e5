"""Planner accuracy on mixtures of experts: `onegpu plan`'s peak against a measured CPU step.

Tiny configurations of five transformers MoE architectures (2 layers, hidden 64, 4 experts,
top-2; the `tiny` preset's batch: 8 x 64 tokens in 2 micro-batches), fp32 and bf16, each real
step in a fresh process. Prints the markdown table of docs/hf-models.md.

Usage: python benchmarks/moe_plan.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ARCHS = ("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "deepseek_v2")
NAMES = {"mixtral": "Mixtral", "qwen3_moe": "Qwen3-MoE", "qwen2_moe": "Qwen2-MoE",
         "deepseek_v3": "DeepSeek-V3", "deepseek_v2": "DeepSeek-V2"}  # fmt: skip


def config(arch: str):
    import transformers

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    router = dict(output_router_logits=True, router_aux_loss_coef=0.01)
    deepseek = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                    n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=None,
                    kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)  # fmt: skip
    return {
        "mixtral": lambda: transformers.MixtralConfig(
            num_local_experts=4, num_experts_per_tok=2, **router, **common),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, head_dim=16,
            **router, **common),
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
            shared_expert_intermediate_size=64, **router, **common),
        # aux-loss-free balancing (a bias on the router): no router loss to add
        "deepseek_v3": lambda: transformers.DeepseekV3Config(**deepseek, **common),
        "deepseek_v2": lambda: transformers.DeepseekV2Config(**deepseek, **common),
    }[arch]()  # fmt: skip


def worker(arch: str, precision: str, folder: str) -> dict:
    from onegpu.backends.torch.step_memory import measure_real_step
    from onegpu.config import load_config
    from onegpu.plan.memory import plan_memory

    config(arch).save_pretrained(folder)
    cfg = load_config("tiny", overrides={"model.hf": folder, "model.seq_len": "64",
                                         "train.device": "cpu", "train.precision": precision})  # fmt: skip
    plan = plan_memory(cfg)
    _, measured = measure_real_step(cfg)
    return {"planned": plan.memory["peak"], "measured": measured["peak"]}


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        print(json.dumps(worker(*sys.argv[2:])))
        return
    mib = 2**20
    lines = ["| model | precision | planned peak | measured | error |", "|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ARCHS:
            cells = []
            for precision in ("fp32", "bf16"):
                folder = str(Path(tmp) / f"{arch}-{precision}")
                out = subprocess.run([sys.executable, __file__, "--worker", arch, precision,
                                      folder], capture_output=True, text=True, check=True)  # fmt: skip
                cells.append(json.loads(out.stdout.strip().splitlines()[-1]))
            p, m = [c["planned"] / mib for c in cells], [c["measured"] / mib for c in cells]
            err = [c["planned"] / c["measured"] - 1 for c in cells]
            lines.append(f"| {NAMES[arch]} | fp32 / bf16 | {p[0]:.2f} / {p[1]:.2f} MiB | "
                         f"{m[0]:.2f} / {m[1]:.2f} MiB | {err[0]:+.2%} / {err[1]:+.2%} |")  # fmt: skip
            print(lines[-1], flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
