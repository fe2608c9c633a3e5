"""Every pair of techniques either trains or is refused up front (one line, exit 2).

The options that interact (precision, checkpointing, compile, chunked loss, optimizer,
offload, accumulation) are crossed pairwise: a covering set of configurations, built greedily,
in which every pair of values that the configuration accepts appears together at least once,
each trained for two steps on `tiny`. A pair that no valid configuration holds must be refused
by the configuration itself, before anything is built."""

import functools
import itertools

import pytest
import torch

from onegpu.config import ConfigError, load_config

DIMS: dict[str, list[str]] = {
    "train.precision": ["fp32", "bf16", "bf16-pure"],
    "memory.checkpointing": ["none", "selective", "attn+mlp", "block"],
    "train.compile": ["none", "default", "regional"],
    "memory.loss_chunk": ["0", "128"],
    "optim.name": ["adamw", "adamw8bit", "sgd", "adafactor"],
    "offload": ["none", "activations", "optimizer"],
    "train.micro_batch_size": ["4", "2"],
}
OFFLOAD = {"none": {}, "activations": {"memory.offload_activations": "true"},
           "optimizer": {"memory.offload_optimizer": "true"}}  # fmt: skip
BASE = {"train.device": "cpu", "train.batch_size": "4", "train.max_steps": "2", "optim.warmup_steps": "0",
        "model.dropout": "0.0", "out.progress": "false"}  # fmt: skip


def overrides(choice: dict[str, str]) -> dict[str, str]:
    out = dict(BASE)
    for k, v in choice.items():
        out.update(OFFLOAD[v] if k == "offload" else {k: v})
    return out


@functools.cache
def _accepted(choice: frozenset) -> bool:
    try:
        load_config("tiny", overrides=overrides(dict(choice)))
    except ConfigError:
        return False
    return True


def _valid(choice: dict[str, str]) -> bool:
    return _accepted(frozenset(choice.items()))


def covering_set() -> tuple[list[dict[str, str]], list[tuple]]:
    """(configurations covering every accepted pair, the pairs no configuration accepts)."""
    keys = list(DIMS)
    pairs = {((a, va), (b, vb)) for a, b in itertools.combinations(keys, 2)
             for va in DIMS[a] for vb in DIMS[b]}  # fmt: skip
    configs, refused = [], []
    while pairs:
        (a, va), (b, vb) = first = min(pairs)
        choice = {a: va, b: vb}
        for k in keys:
            if k in choice:
                continue
            scored = []
            for v in DIMS[k]:
                trial = {**choice, k: v}
                gain = sum(((x, trial[x]), (y, trial[y])) in pairs
                           for x, y in itertools.combinations([q for q in keys if q in trial], 2))  # fmt: skip
                scored.append((-gain, DIMS[k].index(v), v))
            ranked = [v for _, _, v in sorted(scored)]
            rest = {q: DIMS[q][0] for q in keys if q not in choice and q != k}
            valid = [v for v in ranked if _valid({**choice, k: v, **rest})]
            choice[k] = (valid or ranked)[0]
        if not _valid(choice):
            refused.append(first)
            pairs.discard(first)
            continue
        configs.append(choice)
        pairs -= {((x, choice[x]), (y, choice[y])) for x, y in itertools.combinations(keys, 2)}
    return configs, refused


CONFIGS, REFUSED = covering_set()


@pytest.mark.slow
@pytest.mark.parametrize("choice", CONFIGS, ids=lambda c: ",".join(f"{v}" for v in c.values()))
def test_every_accepted_pair_trains(choice):
    from onegpu.backends.torch.build import build

    torch._dynamo.reset()
    cfg = load_config("tiny", overrides=overrides(choice))
    built = build(cfg, torch.device("cpu"), with_data=False)
    x = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(0))
    for i in range(2):
        out = built.step(x[:, :-1], x[:, 1:], x[:, 1:].numel(), i)
    assert torch.isfinite(out.loss) and not bool(out.skipped)


@pytest.mark.parametrize("pair", REFUSED, ids=lambda p: f"{p[0][0]}={p[0][1]}+{p[1][0]}={p[1][1]}")
def test_a_pair_no_configuration_accepts_is_refused_in_one_line(pair, capsys):
    """Refused by the configuration (before any build), exit 2, one line, no traceback."""
    from onegpu.cli import main

    (a, va), (b, vb) = pair
    choice = {a: va, b: vb}
    with pytest.raises(ConfigError):
        load_config("tiny", overrides=overrides(choice))
    args = [f"--{k}={v}" for k, v in overrides(choice).items()]
    assert main(["train", "--preset", "tiny", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len([line for line in err if "error" in line]) == 1 and "Traceback" not in "".join(err)


def test_the_covering_set_covers_every_pair():
    keys = list(DIMS)
    covered = {((x, c[x]), (y, c[y])) for c in CONFIGS for x, y in itertools.combinations(keys, 2)}
    every = {((a, va), (b, vb)) for a, b in itertools.combinations(keys, 2)
             for va in DIMS[a] for vb in DIMS[b]}  # fmt: skip
    assert every == covered | set(REFUSED)
    assert len(CONFIGS) < 60  # pairwise, not the full product (3,456)
