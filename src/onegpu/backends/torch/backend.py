"""The torch backend of the run lifecycle (runs/backend.py): the one build, the one TrainStep,
the torch state as checkpoint bytes. The lifecycle (runs/lifecycle.py) drives it; nothing here
knows the loop's cadence, the run folder's rules or the checkpoints' names."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.profiler import record_function

from onegpu.backends.torch import checkpoint as ckpt
from onegpu.backends.torch import report, writes
from onegpu.backends.torch.batches import training_batches, validation_batches
from onegpu.backends.torch.build import Built, build, processes, resolve_device
from onegpu.backends.torch.loader import DevicePrefetcher
from onegpu.backends.torch.oom import out_of_memory_report
from onegpu.backends.torch.step_memory import measure_step, measured_step
from onegpu.backends.torch.totals import meter_for
from onegpu.config import Config, ConfigError
from onegpu.config.environment import local_world_size_from_env
from onegpu.distributed import DistContext
from onegpu.memory.measure import reset_peak
from onegpu.perf import allocator
from onegpu.runs.backend import Stepped
from onegpu.runs.checkpoints import Checkpoint
from onegpu.runs.folder import RunFolder
from onegpu.runs.meter import Meter

MemoryCheck = Callable[[Config, torch.device, int, int], object]
"""Plans a configuration before it allocates: (config, device, world size, processes on this
machine) (plan/startup.py; the planner sits above the backends, so the caller hands it in)."""
CheckpointingPlan = Callable[[Config, torch.device], Config]
"""Decides `memory.checkpointing budget:BYTES` per block on the run's device (plan/budget.py,
handed in for the same reason)."""


class TorchBackend:
    name = "torch"

    def __init__(
        self,
        memory_check: MemoryCheck | None = None,
        plan_checkpointing: CheckpointingPlan | None = None,
    ):
        self._memory_check = memory_check
        self._plan_checkpointing = plan_checkpointing
        self._planned: tuple[Config, Config] | None = None  # (as given, as decided)
        self.ctx: DistContext | None = None
        self.built: Built | None = None
        self.tokenizer: Any = None
        self.chat_template: str | None = None
        self._batches: DevicePrefetcher | None = None
        self._eval_batches: list = []
        self._measure_at: int | None = None
        self._memory: dict[str, Any] = {}

    @contextlib.contextmanager
    def processes(self, cfg: Config) -> Iterator[DistContext]:
        allocator.apply()  # library users get the tuned glibc malloc too (perf/allocator.py)
        with processes(cfg) as self.ctx:
            yield self.ctx

    @property
    def checkpoint_suffix(self) -> str:
        return "" if self.ctx is not None and self.ctx.enabled else ckpt.SUFFIX

    def _decided(self, cfg: Config) -> Config:
        """`cfg` with its checkpointing budget decided, once per run (one process: several
        are refused by the build in one line)."""
        if self._plan_checkpointing is None or self.ctx.enabled:
            return cfg
        if self._planned is None or self._planned[0] is not cfg:
            device = resolve_device(cfg.train.device)
            self._planned = (cfg, self._plan_checkpointing(cfg, device))
        return self._planned[1]

    def check_memory(self, cfg: Config) -> None:
        # each process its own share, rank 0 first (the others read its cached plan)
        cfg = self._decided(cfg)
        if self._memory_check is None:
            return
        ctx = self.ctx
        device = resolve_device(cfg.train.device, ctx.local_rank if ctx.enabled else None)
        per_machine = local_world_size_from_env()
        refusal: ConfigError | None = None
        try:
            ctx.main_first(lambda: self._memory_check(cfg, device, ctx.world_size, per_machine))
        except ConfigError as e:
            refusal = e
        if ctx.any_true(refusal is not None):  # every process stops when one cannot fit
            raise refusal or ConfigError(
                "train.skip_memory_check",
                "another process of this job does not fit (its line above says why)",
            )

    def build(self, cfg: Config) -> Config:
        self.built = build(self._decided(cfg), dist_ctx=self.ctx)
        self.tokenizer = self.built.data.tokenizer
        self.chat_template = self.built.data.chat_template
        return self.built.cfg

    def data_fingerprint(self) -> str | None:
        data = self.built.data if self.built is not None else None
        return data.fingerprint() if data is not None else None

    def read_checkpoint(self, path: Path) -> dict[str, Any]:
        return ckpt.read(path)

    def load_state(self, checkpoint: Checkpoint) -> None:
        ckpt.load_state(self.built, checkpoint)

    def start(self, step: int) -> None:
        # the loader draws its seed from the global generator, before seed() sets it
        self._batches = training_batches(self.built, step)
        self._eval_batches = validation_batches(self.built)
        self._measure_at = measured_step(self.built)
        self.built.model.train()
        reset_peak(self.built.device)

    def meter(self) -> Meter:
        return meter_for(self.built, report.run_peak(self.built))

    def describe(self, out_dir: Path, start: int) -> str:
        return report.describe(self.built, out_dir, start)

    def seed(self, checkpoint: Checkpoint | None) -> None:
        ckpt.start_rng(self.built, checkpoint)

    def guard(self, run: RunFolder, meter: Meter) -> contextlib.AbstractContextManager[None]:
        return out_of_memory_report(run, self.built.device, meter)

    def step(self, step: int) -> Stepped:
        with record_function("data"):
            x, y, n_tokens, positions = next(self._batches)
        tokens = x.numel() * self.built.dist.dp_size  # every data-parallel share is equal
        if step == self._measure_at:  # optimizer states exist by then, as in every later step
            t0 = time.perf_counter()
            out, self._memory = measure_step(self.built, x, y, n_tokens, step, positions)
            return Stepped(out, tokens, n_tokens, measured_s=time.perf_counter() - t0)
        return Stepped(self.built.step(x, y, n_tokens, step, positions), tokens, n_tokens)

    def evaluate(self) -> float:
        return self.built.step.evaluate(self._eval_batches)

    def weights_finite(self) -> bool:
        return writes.weights_finite(self.built)

    def write_checkpoint(
        self, path: Path, common: dict[str, Any], *, wait: bool
    ) -> Callable[[], None] | None:
        return writes.write_checkpoint(self.built, path, common, wait=wait)

    def final_weights(self, path: Path) -> None:
        writes.write_final_weights(self.built, path)

    def summary(self, meter: Meter, step_s: float | None, interrupted: bool) -> dict[str, Any]:
        return report.torch_summary(self.built, self._memory, step_s, interrupted=interrupted)

    def finished(self, summary: dict[str, Any]) -> None:
        report.recheck_peak(self.built, summary)
