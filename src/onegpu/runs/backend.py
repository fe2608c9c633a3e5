"""What the run lifecycle (runs/lifecycle.py) asks of a training backend: the small typed
protocol torch (backends/torch/backend.py) and JAX (backends/jax/backend.py) implement. The
lifecycle owns everything else: the folder and its lock, checkpoints and their checks, signals,
the progress bar, the loop's cadence, the summary. No framework import here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from onegpu.config import Config
from onegpu.runs.checkpoints import Checkpoint
from onegpu.runs.folder import RunFolder
from onegpu.runs.meter import Meter

T = TypeVar("T")


class Processes(Protocol):
    """The processes of a run: one, or a torchrun job (distributed.DistContext)."""

    world_size: int

    @property
    def is_main(self) -> bool:
        """This process speaks and writes the run folder."""

    def on_main(self, fn: Callable[[], T]) -> T:
        """`fn` on the main process, its result (or its ConfigError) on every process."""

    def barrier(self) -> None: ...

    def gather(self, obj: Any) -> list[Any]: ...

    def say(self, message: str, write: Callable[[str], None] = print) -> None:
        """A line from the main process."""


@dataclass(frozen=True, slots=True)
class OneProcess:
    """A run of one process: every collective is the identity."""

    world_size: int = 1
    is_main: bool = True

    def on_main(self, fn: Callable[[], T]) -> T:
        return fn()

    def barrier(self) -> None:
        pass

    def gather(self, obj: Any) -> list[Any]:
        return [obj]

    def say(self, message: str, write: Callable[[str], None] = print) -> None:
        write(message)


@dataclass(frozen=True, slots=True)
class Stepped:
    """One training step as the loop accounts it."""

    out: Any
    """The backend's step output, summed on its device by the meter's Totals."""
    tokens: int
    """Tokens of the global batch (every process runs an equal share)."""
    trained: int | None = None
    """Of those, the targets that carry loss (None: every one)."""
    measured_s: float | None = None
    """Set when the step ran under the memory profiler: its seconds count in no speed figure."""


class Backend(Protocol):
    """A framework's part of a run. Called in this order: processes -> check_memory -> build
    -> (load_state) -> start -> meter -> describe -> seed -> guard(step, evaluate,
    write_checkpoint...) -> summary -> finished -> final_weights."""

    name: str
    """'torch' or 'jax': written into every checkpoint; another backend's run is refused."""

    def processes(self, cfg: Config) -> contextlib.AbstractContextManager[Processes]:
        """The run's processes, opened for the run's life (a process group under torchrun)."""

    @property
    def checkpoint_suffix(self) -> str:
        """A checkpoint's name after `step-00000050`: '.pt', '.jax', or '' for a folder."""

    def check_memory(self, cfg: Config) -> None:
        """Refuse (ConfigError) a configuration that cannot fit this machine, before anything
        is allocated; a check that cannot decide says so and lets the run start."""

    def build(self, cfg: Config) -> Config:
        """Data, model, optimizer and step; returns the resolved config (what runs)."""

    tokenizer: Any
    """The data's tokenizer (written into the run folder), once built."""
    chat_template: str | None
    """The chat template of chat data (written into the run folder), once built."""

    def data_fingerprint(self) -> str | None:
        """What the data is, for the same-data check of a resume."""

    def read_checkpoint(self, path: Path) -> dict[str, Any]:
        """A checkpoint's state (a folder's: its shared part), or ConfigError naming
        train.resume when it does not load."""

    def load_state(self, checkpoint: Checkpoint) -> None:
        """Model, optimizer and what else the step needs, as the checkpoint has them. The
        checkpoint's weights and optimizer state are dropped from it once restored: the run
        keeps `checkpoint` to its end and must not hold a second copy of the model."""

    def start(self, step: int) -> None:
        """Open the batches from global step `step` on."""

    def meter(self) -> Meter:
        """The run's meter: the backend's device-side totals, clock sync and memory reading."""

    def describe(self, out_dir: Path, start: int) -> str:
        """The run's header line."""

    def seed(self, checkpoint: Checkpoint | None) -> None:
        """The random streams the steps draw from: from the seed, or as the checkpoint saved
        them (right before the first step, after anything else has drawn)."""

    def guard(self, run: RunFolder, meter: Meter) -> contextlib.AbstractContextManager[None]:
        """Around the loop: turns the framework's out-of-memory failure into an answer."""

    def step(self, step: int) -> Stepped:
        """One optimizer step on the next batch."""

    def evaluate(self) -> float:
        """Mean validation loss over the fixed validation batches."""

    def weights_finite(self) -> bool:
        """Whether every weight is finite (over every process)."""

    def write_checkpoint(
        self, path: Path, common: dict[str, Any], *, wait: bool
    ) -> Callable[[], None] | None:
        """Write the state after `common['step']` steps as the checkpoint `path`, atomically
        (runs/checkpoints.py's rules). Returns None when it is on disk, or a callable that
        completes it (a background save; called before the next one and at the end)."""

    def final_weights(self, path: Path) -> None:
        """The trained weights as model.safetensors at `path` (a collective)."""

    def summary(self, meter: Meter, step_s: float | None, interrupted: bool) -> dict[str, Any]:
        """The backend's fields of summary.json: memory, device, versions, compilation, and
        `floor_s`, the matmul floor of a step (`step_s` as measured), where the backend
        measures one and the run was not stopped by a signal (its summary is written at once)."""

    def finished(self, summary: dict[str, Any]) -> None:
        """After the run: what its numbers show about this machine (a stale peak)."""


@contextlib.contextmanager
def no_guard() -> Iterator[None]:
    yield
