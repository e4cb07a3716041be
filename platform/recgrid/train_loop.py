"""What every worker runs: build its training state, take steps, sync replicas, time phases.

Not tied to a launcher: the Ray launcher and the local multi-process launcher both call
`build_train_state` and `train_loop` with a grid, an engine config and an iterator of batches.
The worker's whole training state is one object, `TrainState`, so recovery can snapshot and
restore it without touching the loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ShardingPlan

from recgrid.device import synchronize
from recgrid.grid import Grid, GridGroups
from recgrid.model import ModelSpec, build_model
from recgrid.optimizer import MomentScaledRowWiseAdagrad, dense_optimizer
from recgrid.sharding import shard_model
from recgrid.specs import DatasetSpec
from recgrid.sync import ReplicaSync

PHASES = ("data_wait", "lookup", "lookup_kernel", "dense", "sync")


@dataclass(frozen=True)
class EngineConfig:
    """Everything a worker needs to build its part of the 2-D engine.

    Attributes:
        spec: the dataset spec (tables and their rows).
        model: the dense architecture.
        embedding_optimizer: moment-scaled row-wise AdaGrad (its `moment_scale` is c).
        dense_optimizer: "adagrad", "adam" or "sgd"; dense_lr its learning rate.
        sync_every: K, steps between replica syncs.
        delayed_moment_sync: average optimizer states one sync late, overlapped with compute.
        sharding: a TorchRec sharding type for every table, or "auto" for the planner's choice.
        seed: seeds the dense initialisation (identical on every worker).
    """

    spec: DatasetSpec
    model: ModelSpec = ModelSpec()
    embedding_optimizer: MomentScaledRowWiseAdagrad = MomentScaledRowWiseAdagrad()
    dense_optimizer: str = "adagrad"
    dense_lr: float = 0.01
    sync_every: int = 1
    delayed_moment_sync: bool = False
    sharding: str = "auto"
    seed: int = 0


class PhaseTimer:
    """Wall-clock seconds per phase of the step, summed since the last `take()`.

    "lookup" is the sparse arch's forward (id all-to-all, kernel lookup, pooled all-to-all);
    "lookup_kernel" is this worker's fused-kernel lookups alone (its share of the work: the
    lookup-imbalance metric compares it across workers); "dense" is the rest of forward and
    backward and the dense optimizer; "sync" the replica sync; "data_wait" waiting for a batch.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = {p: 0.0 for p in PHASES}
        self._open: dict[str, float] = {}

    def start(self, phase: str) -> None:
        synchronize(self.device)
        self._open[phase] = time.perf_counter()

    def stop(self, phase: str) -> float:
        synchronize(self.device)
        elapsed = time.perf_counter() - self._open.pop(phase)
        self.seconds[phase] += elapsed
        return elapsed

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds

    def attach(self, model: nn.Module) -> None:
        """Time the sparse arch and the lookup kernels with forward hooks."""
        from torchrec.models.dlrm import SparseArch

        for m in model.modules():
            if isinstance(m, SparseArch):
                self._hook(m, "lookup")
                for sub in m.modules():
                    for lookup in getattr(sub, "_lookups", []) or []:
                        self._hook(lookup, "lookup_kernel")

    def _hook(self, module: nn.Module, phase: str) -> None:
        module.register_forward_pre_hook(lambda *_: self.start(phase))
        module.register_forward_hook(lambda *_: self.stop(phase) and None)

    def take(self) -> dict[str, float]:
        out, self.seconds = self.seconds, {p: 0.0 for p in PHASES}
        return out


@dataclass
class TrainState:
    """One worker's whole training state: where it is in the grid, its model and optimizers,
    its sync bookkeeping and its position in the data."""

    grid: Grid
    groups: GridGroups
    device: torch.device
    config: EngineConfig
    model: DistributedModelParallel
    plan: ShardingPlan  # in shard ranks 0..L-1, the same on every worker
    dense_optimizer: torch.optim.Optimizer
    replica_sync: ReplicaSync
    timer: PhaseTimer
    step: int = 0  # finished steps
    examples: int = 0  # examples this worker has trained on
    batches_consumed: int = 0  # position in this worker's data stream

    @property
    def last_sync_step(self) -> int:
        """The last step after which the replicas were averaged (the recovery point)."""
        return self.step - self.step % self.config.sync_every


def build_train_state(grid: Grid, config: EngineConfig, device: torch.device) -> TrainState:
    """Build this worker's sharded model, optimizers and replica sync. Collective: every worker
    of the initialised global process group must call it."""
    groups = grid.build_process_groups(device.type)
    model = build_model(config.spec, config.model, seed=config.seed, dense_device=device)
    dmp, plan = shard_model(model, grid, groups, device, config.embedding_optimizer.fused_params(), config.sharding)
    dense_params = [p for name, p in dmp.named_parameters() if not _is_embedding(name, p)]
    replica_sync = ReplicaSync(dmp, groups.replica_pg, grid.num_groups, config.sync_every, config.delayed_moment_sync)
    replica_sync.align()  # sharding groups initialise their shards independently: start from one copy
    timer = PhaseTimer(device)
    timer.attach(dmp)
    return TrainState(
        grid=grid, groups=groups, device=device, config=config, model=dmp, plan=plan,
        dense_optimizer=dense_optimizer(config.dense_optimizer, dense_params, config.dense_lr),
        replica_sync=replica_sync, timer=timer,
    )


@dataclass
class StepOutput:
    loss: torch.Tensor  # detached scalar
    logits: torch.Tensor  # detached [B]
    labels: torch.Tensor  # [B]
    seconds: float  # compute seconds of this step (forward, backward, optimizers; no sync)


def train_step(state: TrainState, batch: Batch) -> StepOutput:
    """Forward, backward (embedding rows are updated in place by the fused optimizer during
    backward; dense gradients are all-reduced over all T workers by DDP), dense optimizer step."""
    t0 = time.perf_counter()
    batch = batch.to(state.device, non_blocking=True)
    state.dense_optimizer.zero_grad(set_to_none=True)
    loss, (_, logits, labels) = state.model(batch)
    loss.backward()
    state.dense_optimizer.step()
    synchronize(state.device)
    seconds = time.perf_counter() - t0
    state.step += 1
    state.examples += int(labels.numel())
    return StepOutput(loss=loss.detach(), logits=logits, labels=labels, seconds=seconds)


@dataclass
class LoopResult:
    steps: int
    step_seconds: list[float] = field(default_factory=list)  # per step: compute + sync
    losses: list[float] = field(default_factory=list)
    phase_seconds: dict[str, float] = field(default_factory=dict)
    examples: int = 0
    wall_seconds: float = 0.0


StepCallback = Callable[[TrainState, StepOutput], None]


def train_loop(state: TrainState, batches: Iterator[Batch], max_steps: int,
               on_step: StepCallback | None = None) -> LoopResult:
    """Train until `max_steps` finished steps or the batches run out. Syncs replicas every K
    steps. `on_step` runs after every step (after its sync), on every worker; it is where the
    launcher computes and logs metrics."""
    result = LoopResult(steps=0)
    phases = {p: 0.0 for p in PHASES}
    t_start = time.perf_counter()
    it = iter(batches)
    while state.step < max_steps:
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        state.timer.add("data_wait", time.perf_counter() - t0)
        state.batches_consumed += 1
        out = train_step(state, batch)
        record = state.replica_sync.maybe_sync(state.step)
        sync_s = record.seconds if record else 0.0
        state.timer.add("sync", sync_s)
        # the lookup hooks fired inside this step's compute; the rest of it is the dense part
        state.timer.add("dense", max(0.0, out.seconds - state.timer.seconds["lookup"]))
        result.step_seconds.append(out.seconds + sync_s)
        result.losses.append(float(out.loss))
        for phase, s in state.timer.take().items():
            phases[phase] += s
        if on_step is not None:
            on_step(state, out)
    result.steps = len(result.step_seconds)
    result.phase_seconds = phases
    result.examples = state.examples
    result.wall_seconds = time.perf_counter() - t_start
    return result


def _is_embedding(name: str, param: torch.Tensor) -> bool:
    # Fused-kernel tables are updated inside backward; they must not reach the dense optimizer.
    return "embedding_bag" in name or type(param).__name__ == "TableBatchedEmbeddingSlice"


def barrier(state: TrainState) -> None:
    dist.barrier(group=state.groups.global_pg)
