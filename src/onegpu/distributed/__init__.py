"""Scale-out on PyTorch's own distributed engine, under `torchrun`: the process group
(context.py), FSDP2 and DDP applied to a built model (parallelize.py), checkpoints sharded
through Distributed Checkpoint (dcp.py) and the per-rank memory of a plan (plan.py).

Nothing here runs on one process: with `dist.strategy none` (the default on one process) the
build, the step and the checkpoints are exactly the single-device ones.
"""

from onegpu.distributed.context import DistContext, init_distributed, single_process

__all__ = ["DistContext", "init_distributed", "single_process"]
