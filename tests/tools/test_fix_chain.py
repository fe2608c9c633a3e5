"""The fix list's search on a model of a plan (no planning): the fastest change on top of the
others is applied until the configuration fits, and what the end no longer needs is dropped."""

from onegpu.config import load_config
from onegpu.plan.fixes import FIXES, Planned, _Search


class _Modelled(_Search):
    """Peak and step time by rule: block checkpointing saves most and costs a third more
    time, host activations save some for nothing here, the chunked loss saves a little, the
    optimizer in backward saves only once the activations are small."""

    def plan(self, cfg, *, full=False) -> Planned:
        m = cfg.memory
        activations = (
            60 if m.checkpointing == "none" else 30 if m.checkpointing == "selective" else 5
        )
        activations = activations // 2 if m.offload_activations else activations
        grads = 0 if cfg.optim.in_backward else 20
        peak = 20 + max(activations, grads) - (5 if m.loss_chunk else 0)
        step = {"none": 1.0, "selective": 1.05}.get(m.checkpointing, 1.33)
        return Planned(peak=peak, host=0, step_s=step)


def test_the_chain_applies_the_fastest_change_that_lowers_the_peak_then_drops_the_unneeded():
    fixes = [f for f in FIXES if f[0] in ("chunked loss", "selective checkpointing",
             "activations in host memory", "block checkpointing",
             "optimizer step in backward, no clipping")]  # fmt: skip
    cfg = load_config("tiny", overrides={"memory.loss_chunk": "0"})
    search = _Modelled("cuda", None, None, budget=21, host_budget=2**62, fast=False)
    alone = [(name, change, search.plan(cfg)) for name, change in fixes]
    found = search.chain(cfg, 80, alone)
    names = [f["change"] for f in found]
    # the optimizer in backward saves nothing until the activations are below the gradients
    assert names.index("optimizer step in backward, no clipping") > names.index(
        "selective checkpointing"
    )
    assert found[-1]["fits_with_previous"] and found[-1]["change"] == "block checkpointing"
    search.drop_unneeded(cfg, found)
    dropped = {f["change"] for f in found if f.get("dropped")}
    # with block checkpointing the host activations and selective checkpointing no longer
    # matter; the chunked loss and the backward step still do
    assert dropped == {"activations in host memory", "selective checkpointing"}
    overrides = found[-1]["best_overrides"]
    assert overrides["memory.checkpointing"] == "block"
    assert overrides["optim.in_backward"] == "true"
    assert "memory.offload_activations" not in overrides


def test_a_change_beyond_the_host_budget_is_not_applied():
    """With no room on the host, the host tiers are never applied on the way (they would keep
    every later configuration from fitting)."""

    class _HostHungry(_Modelled):
        def plan(self, cfg, *, full=False) -> Planned:
            p = super().plan(cfg)
            host = 50 if cfg.memory.offload_activations else 0
            return Planned(peak=p.peak, host=host, step_s=p.step_s)

    fixes = [f for f in FIXES if f[0] in ("chunked loss", "activations in host memory",
             "block checkpointing", "optimizer step in backward, no clipping")]  # fmt: skip
    cfg = load_config("tiny", overrides={"memory.loss_chunk": "0"})
    search = _HostHungry("cuda", None, None, budget=21, host_budget=10, fast=False)
    alone = [(name, change, search.plan(cfg)) for name, change in fixes]
    found = search.chain(cfg, 80, alone)
    assert "activations in host memory" not in [f["change"] for f in found]
    assert found[-1]["fits_with_previous"]
