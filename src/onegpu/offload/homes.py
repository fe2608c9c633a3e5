"""Where a built run's bytes live, read from what the build made (not from the config): the
optimizer's states (device, host, or disk), the weights (device, or host under FSDP2's CPU
offload) and the activations saved for backward (device, or host). summary.json, `onegpu
profile` and every bench or tune row say it, so a test can check each option took effect."""

from __future__ import annotations

from typing import Any

from onegpu.offload.host_optimizer import HostOffloadOptimizer


def homes(optimizer: Any, loss_fn: Any, *, weights_on_host: bool) -> dict[str, str]:
    """{'optimizer', 'weights', 'activations'}: each 'device', 'host' or 'disk'."""
    if isinstance(optimizer, HostOffloadOptimizer):
        states = "disk" if optimizer.on_disk else "host"
    else:
        states = "host" if weights_on_host else "device"  # FSDP's host shards step there
    return {
        "optimizer": states,
        "weights": "host" if weights_on_host else "device",
        "activations": "host" if getattr(loss_fn, "saves_on_host", False) else "device",
    }
