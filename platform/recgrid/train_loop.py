"""What every worker runs: build its training state, take steps, sync replicas, time phases.

Not tied to a launcher: the Ray launcher and the local multi-process launcher both call
`build_train_state` and `train_loop` with a grid, an engine config and an iterator of batches.
The worker's whole training state is one object, `TrainState`, so recovery can snapshot and
restore it without touching the loop.
"""

from __future__ import annotations

import itertools
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
from recgrid.metrics import PhaseTimer
from recgrid.model import ModelSpec, build_model
from recgrid.optimizer import MomentScaledRowWiseAdagrad, dense_optimizer
from recgrid.sharding import shard_model
from recgrid.specs import DatasetSpec
from recgrid.sync import ReplicaSync

# "dense" is the step's compute minus "lookup"; "sync" the replica sync; "data_wait" the wait for a batch
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


def attach_lookup_timers(timer: PhaseTimer, model: nn.Module) -> None:
    """Charge the sparse arch's forward to "lookup" and the fused-kernel lookups inside it to
    "lookup_kernel", with forward hooks.

    "lookup" is the id all-to-all, the kernel lookups and the pooled all-to-all; "lookup_kernel"
    is this worker's kernel lookups alone (its share of the work: the lookup-imbalance metric
    compares it across workers, free of the waits inside the all-to-alls).
    """
    from torchrec.models.dlrm import SparseArch

    def hook(module: nn.Module, phase: str) -> None:
        module.register_forward_pre_hook(lambda *_: timer.start(phase))
        module.register_forward_hook(lambda *_: timer.stop(phase) and None)

    for m in model.modules():
        if isinstance(m, SparseArch):
            hook(m, "lookup")
            for sub in m.modules():
                for lookup in getattr(sub, "_lookups", []) or []:
                    hook(lookup, "lookup_kernel")


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
    replica_sync = ReplicaSync(dmp, groups.replica_pg, grid.num_groups, config.sync_every, config.delayed_moment_sync)
    replica_sync.align()  # sharding groups initialise their shards independently: start from one copy
    timer = PhaseTimer(PHASES, synchronize=(lambda: synchronize(device)) if device.type == "cuda" else None)
    attach_lookup_timers(timer, dmp)
    return TrainState(
        grid=grid, groups=groups, device=device, config=config, model=dmp, plan=plan,
        dense_optimizer=dense_optimizer(config.dense_optimizer, dense_parameters(dmp), config.dense_lr),
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
    """Train until `max_steps` finished steps or the batches run out; replicas sync every K steps.
    `on_step` runs after every step (after its sync) on every worker."""
    result = LoopResult(steps=0, phase_seconds={p: 0.0 for p in PHASES})
    t_start = time.perf_counter()

    def record(st: TrainState, out: StepOutput) -> None:
        result.step_seconds.append(out.seconds + st.timer.seconds["sync"])
        result.losses.append(float(out.loss))
        for phase, seconds in st.timer.take().items():
            result.phase_seconds[phase] += seconds
        if on_step is not None:
            on_step(st, out)

    run_steps(state, batches, max_steps, record)
    result.steps = len(result.step_seconds)
    result.examples = state.examples
    result.wall_seconds = time.perf_counter() - t_start
    return result


def run_steps(state: TrainState, batches: Iterator[Batch], max_steps: int, on_step: StepCallback) -> None:
    """The step loop: take a batch, step, sync if due, account the phases, call `on_step` (which
    takes the phase seconds out of `state.timer`)."""
    it = iter(batches)
    while state.step < max_steps:
        t0 = time.perf_counter()
        batch = next(it, None)
        if batch is None:
            return
        state.timer.add("data_wait", time.perf_counter() - t0)
        state.batches_consumed += 1
        out = train_step(state, batch)
        record = state.replica_sync.maybe_sync(state.step)
        state.timer.add("sync", record.seconds if record else 0.0)
        # the lookup hooks fired inside this step's compute; the rest of it is the dense part
        state.timer.add("dense", max(0.0, out.seconds - state.timer.seconds["lookup"]))
        on_step(state, out)


def dense_parameters(model: nn.Module) -> list[torch.nn.Parameter]:
    """The data-parallel parameters. Fused-kernel tables are updated inside backward and must
    not reach the dense optimizer."""
    return [p for name, p in model.named_parameters()
            if "embedding_bag" not in name and type(p).__name__ != "TableBatchedEmbeddingSlice"]


# ---- a whole job on one worker: epochs, metrics, evaluation ----------------------------------------
@dataclass(frozen=True)
class FitConfig:
    """How long to train and how often to log and evaluate (steps)."""

    max_steps: int
    log_every: int = 50
    eval_every: int = 0  # 0: evaluate only at the end
    ne_window_steps: int = 100


LogFn = Callable[[dict, int], None]


def lockstep(batches: Iterator[Batch], state: TrainState, pad: Batch | None, until: str) -> Iterator[tuple[Batch, bool]]:
    """Yield `(batch, real)` the same number of times on every worker.

    Every forward pass is collective (all-to-all inside the sharding group, DDP over all T), so
    workers must agree on how many they take. until="any": stop as soon as any worker's stream
    ends (training; the others' last few batches wait for the next epoch). until="all": go on
    until every stream ends, feeding `pad` (marked not real) to workers already done (evaluation).
    """
    op = dist.ReduceOp.MIN if until == "any" else dist.ReduceOp.MAX
    it = iter(batches)
    last = pad
    while True:
        batch = next(it, None)
        flag = torch.tensor([0 if batch is None else 1], device=state.device)
        dist.all_reduce(flag, op=op, group=state.groups.global_pg)
        if int(flag) == 0:
            return
        if batch is not None:
            last = batch
            yield batch, True
        else:
            if last is None:
                raise RuntimeError("this worker got no evaluation rows and no padding batch was given")
            yield last, False


def evaluate(state: TrainState, batches: Iterator[Batch], pad: Batch | None = None) -> dict[str, float]:
    """NE, AUC, log loss over every eval row of every worker (sums reduced, never averages)."""
    from recgrid.metrics import EvalMetrics, reduce_metrics

    evaluation = EvalMetrics(device=state.device)
    state.model.eval()
    try:
        with torch.no_grad():
            for batch, real in lockstep(batches, state, pad, until="all"):
                _, (_, logits, labels) = state.model(batch.to(state.device, non_blocking=True))
                if real:
                    evaluation.update(torch.sigmoid(logits.float()), labels)
    finally:
        state.model.train()
    return reduce_metrics(state.groups.global_pg, evaluation=evaluation)


def fit(state: TrainState, train_epoch: Callable[[], Iterator[Batch]], fit_config: FitConfig,
        eval_epoch: Callable[[], Iterator[Batch]] | None = None, on_log: LogFn | None = None) -> dict[str, float]:
    """Train for `max_steps`, starting a new epoch of `train_epoch()` whenever one runs out.

    Every `log_every` steps (and at the end) the workers' metrics are reduced over all T workers
    and handed to `on_log(metrics, step)` on every worker (the caller logs from one of them).
    Evaluation runs every `eval_every` steps and at the end. Returns the last metrics.
    """
    from recgrid.metrics import TrainMetrics, reduce_metrics

    metrics = TrainMetrics(window_steps=fit_config.ne_window_steps, device=state.device, phases=PHASES,
                           imbalance_phase="lookup_kernel")
    last: dict[str, float] = {}
    pad: Batch | None = None
    evaluated_at = -1

    def log(values: dict[str, float]) -> None:
        last.update(values)
        if on_log is not None:
            on_log(values, state.step)

    def run_eval() -> None:
        nonlocal evaluated_at
        if eval_epoch is not None and evaluated_at != state.step:
            log(evaluate(state, eval_epoch(), pad))
            evaluated_at = state.step

    def on_step(st: TrainState, out: StepOutput) -> None:
        metrics.update(torch.sigmoid(out.logits.float()), out.labels, out.loss)
        for phase, seconds in st.timer.take().items():
            metrics.timer.add(phase, seconds)
        if st.step % fit_config.log_every == 0 or st.step == fit_config.max_steps:
            values = reduce_metrics(st.groups.global_pg, train=metrics)
            values.update(_sync_metrics(st))
            metrics.reset_interval()
            log(values)
        if fit_config.eval_every and st.step % fit_config.eval_every == 0:
            run_eval()

    epoch = 0
    while state.step < fit_config.max_steps:
        start = state.step
        batches = (b for b, _ in lockstep(train_epoch(), state, None, until="any"))
        first = next(batches, None)
        if first is None:
            raise RuntimeError(f"the training data ran out at step {state.step} (epoch {epoch} gave no batch)")
        pad = pad or first
        run_steps(state, itertools.chain([first], batches), fit_config.max_steps, on_step)
        epoch += 1
        if state.step == start:
            break
    run_eval()
    last["train/epochs"] = float(epoch)
    return last


def _sync_metrics(state: TrainState) -> dict[str, float]:
    s = state.replica_sync.stats
    return {
        "sync/count": float(s.count),
        "sync/seconds_total": s.seconds,
        "sync/bytes_total": float(s.bytes),
        "sync/seconds_last": s.last.seconds if s.last else 0.0,
        "sync/bytes_last": float(s.last.bytes) if s.last else 0.0,
    }
