"""One worker's trainer: its runtime handles, the state that must survive, and the loop.

`Trainer` separates two things, as TorchTitan's trainer does:
- runtime handles, rebuilt on every start: process groups, device, the sharded model wrapper,
  the optimizer objects, the replica sync, the metrics component and its phase timer;
- `TrainerState`, the state that must survive a restart: step, examples, the data cursor, the
  replica sync's counters and in-flight delayed average, the evaluation mark. Together with the
  model's and optimizers' tensors and the NE window, `Trainer.state_dict()` /
  `load_state_dict()` give all of it (storage checkpoints, `train.checkpoint`), and
  `snapshot()` / `restore()` give this worker's share of it as plain tensors (in-memory copies
  kept by `train.recovery`). The loop never knows which source a restore came from.

The sharding plan is the job's, made once and replayed (`engine.sharding.make_plan`); a
trainer built without one agrees on one with its peers (local launches, tests, benchmarks).

On CUDA (`engine.device` decides every CPU/GPU difference) the loop differs in three ways; the
CPU loop is the plain one, step by step, timed on the host clock:
- Steps run through TorchRec's `TrainPipelineSparseDist`, which copies batch i+2 to the device
  and runs batch i+1's input all-to-all on side streams while batch i computes. Steps are
  counted from the pipeline's outputs (one per trained batch), so the step, the examples and
  the data cursor count trained batches only; batches it has prefetched but not trained are
  not in the state. The replica sync runs after a step's optimizer, as in the plain loop (the
  pipeline only looks ahead at ids, never at weights), so snapshots and checkpoints at sync
  points hold exactly the plain loop's state. A restore drops the pipeline with its prefetched
  batches (the restored cursor says where the data resumes); an evaluation drops it too, and its
  prefetched batches are fed again to the next one (`BatchFeeder`), so no row is skipped or
  trained twice. The pipeline only reads ahead within what the loop will train (a segment's
  remaining steps, `max_steps`), so it drains at the end of every epoch and of training.
- Phases are timed with CUDA events (`train.metrics.DeferredPhaseTimer`) read once per logging
  interval: no `torch.cuda.synchronize()` per step. "dense" is the step's device time minus its
  "lookup" spans; "data_wait" is the host's wait for the next batch, before the step opens.
- Precision (`EngineConfig.precision`): TF32 matmuls by default, fp32, or bf16 autocast of the
  forward; fp16 tables come with the model (`ModelSpec.embedding_dtype`, TorchRec's table data
  type, which sets the fused kernel's weights precision).
The plain loop stays available on CUDA (`pipeline=False`: it synchronizes every step) to compare.
"""

from __future__ import annotations

import itertools
import json
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from recgrid.data.specs import DatasetSpec
from recgrid.data.stream import EvalData, TrainData
from recgrid.data.units import DataCursor
from recgrid.engine.device import autocast, configure_matmul, pipelined, resolve_precision, synchronize
from recgrid.engine.grid import Grid, GridGroups
from recgrid.engine.model import ModelSpec, build_model
from recgrid.engine.optimizer import MomentScaledRowWiseAdagrad, dense_optimizer, moment_scale_for
from recgrid.engine.sharding import agree_on_plan, plan_record, shard_model
from recgrid.engine.sync import PendingAverage, ReplicaSync, SyncState, embedding_weights, optimizer_states
from recgrid.engine.towers import TowerConfig
from recgrid.train.metrics import EvalMetrics, TrainMetrics, reduce_metrics


@dataclass(frozen=True)
class EngineConfig:
    """Everything a worker needs to build its part of the 2-D engine.

    Attributes:
        spec: the dataset spec (tables and their rows).
        model: the dense architecture.
        lr, eps: the embedding tables' moment-scaled row-wise AdaGrad.
        moment_scale: c; None = M of the grid the trainer is built on (`moment_scale_for`).
        dense_optimizer: "adagrad", "adam" or "sgd"; dense_lr its learning rate.
        sync_every: K, steps between replica syncs.
        delayed_moment_sync: average optimizer states one sync late, overlapped with compute.
        sharding: a TorchRec sharding type for every table, or "auto" for the planner's choice.
        seed: seeds the dense initialisation (identical on every worker) and the data order.
        towers: Disaggregated Multi-Tower (`engine.towers`): the towers, their modules and the
            exchange; None = TorchRec's flat exchange (and `sharding` applies).
        precision: dense compute: "fp32", "tf32" (TensorFloat-32 matmuls) or "bf16" (bfloat16
            autocast of the forward); None = the device's default (`engine.device.default_precision`:
            tf32 on CUDA, fp32 on CPU). tf32 and bf16 need CUDA.
    """

    spec: DatasetSpec
    model: ModelSpec = ModelSpec()
    lr: float = 0.05
    eps: float = 1e-8
    moment_scale: float | None = None
    dense_optimizer: str = "adagrad"
    dense_lr: float = 0.01
    sync_every: int = 1
    delayed_moment_sync: bool = False
    sharding: str = "auto"
    seed: int = 0
    towers: TowerConfig | None = None
    precision: str | None = None

    def embedding_optimizer(self, num_groups: int) -> MomentScaledRowWiseAdagrad:
        return MomentScaledRowWiseAdagrad(lr=self.lr, eps=self.eps,
                                          moment_scale=moment_scale_for(num_groups, self.moment_scale))


@dataclass(frozen=True)
class LoopConfig:
    """How long to train, and how often to log, evaluate, snapshot and checkpoint (in steps)."""

    max_steps: int
    batch_size: int
    log_every: int = 50
    eval_every: int = 0  # 0: evaluate only at the end
    ne_window_steps: int = 100
    checkpoint_every: int = 0  # 0: no storage checkpoints
    snapshot_every_syncs: int = 1  # 0: no in-memory snapshots


@dataclass
class TrainerState:
    """The scalar state that must survive a restart (the tensors live in the model and
    optimizers; `Trainer.state_dict()` gathers everything)."""

    step: int = 0  # finished steps
    examples: int = 0  # examples trained by all workers
    cursor: DataCursor = field(default_factory=DataCursor)
    sync: SyncState = field(default_factory=SyncState)
    evaluated_at: int = -1

    def progress(self) -> dict[str, Any]:
        return {"step": self.step, "examples": self.examples, "cursor": self.cursor.state_dict(),
                "sync": self.sync.counters(), "evaluated_at": self.evaluated_at}

    def load_progress(self, p: dict[str, Any]) -> None:
        self.step, self.examples, self.evaluated_at = int(p["step"]), int(p["examples"]), int(p["evaluated_at"])
        self.cursor.load_state_dict(p["cursor"])
        self.sync.load_counters(p["sync"])


@dataclass
class StepOutput:
    loss: torch.Tensor  # detached scalar
    logits: torch.Tensor  # detached [B]
    labels: torch.Tensor  # [B]
    seconds: float  # compute seconds of this step (forward, backward, optimizers; no sync)


@dataclass
class Snapshot:
    """One worker's share of the training state as plain CPU tensors: its shards (embedding
    weights, optimizer states, and with delayed moment sync the average in flight), the dense
    part, and the scalar progress. The shards are the same for every member of a replica group
    right after a sync; the dense part and progress are the same on every worker."""

    shard: list[torch.Tensor]
    dense: dict[str, torch.Tensor]
    progress: dict[str, Any]
    window: torch.Tensor


@dataclass
class FitHooks:
    """What the caller plugs into `Trainer.fit` (all run on every worker).

    on_log(metrics, step): the metrics reduced over all workers, every log_every steps, at the
        end and after each evaluation.
    at_sync_point(trainer): after the step's replica sync, every K steps (also when M = 1):
        where snapshots and checkpoints are taken.
    on_step(trainer, out, batch): after every step (heartbeats, row audits).
    stop_requested(trainer): at every logging interval; True (the same on every worker) ends
        training there, as if max_steps were reached (a graceful stop).
    """

    on_log: Callable[[dict[str, float], int], None] | None = None
    at_sync_point: Callable[["Trainer"], None] | None = None
    on_step: Callable[["Trainer", StepOutput, Any], None] | None = None
    stop_requested: Callable[["Trainer"], bool] | None = None


@dataclass
class LoopResult:
    steps: int
    step_seconds: list[float] = field(default_factory=list)  # per step: compute + sync
    losses: list[float] = field(default_factory=list)
    phase_seconds: dict[str, float] = field(default_factory=dict)
    examples: int = 0
    wall_seconds: float = 0.0


class Trainer:
    """One worker's part of the 2-D engine and its training state (see the module docstring).

    Building it is collective: every worker of `groups.global_pg` builds one. `pipeline` picks
    the loop: None = the device's (`engine.device.pipelined`: TorchRec's TrainPipelineSparseDist
    on CUDA, the plain loop on CPU); True or False to compare the two (the pipelined loop also
    runs on CPU with gloo, without streams to overlap on: tests check its step accounting there).
    """

    def __init__(self, grid: Grid, groups: GridGroups, config: EngineConfig, device: torch.device,
                 plan: Any = None, ne_window_steps: int = 100, pipeline: bool | None = None) -> None:
        self.grid, self.groups, self.config, self.device = grid, groups, config, device
        self.rank = groups.coords.rank
        self.precision = resolve_precision(device, config.precision)
        configure_matmul(device, self.precision)  # before any kernel runs; refuses tf32/bf16 off CUDA
        # recgrid's own tower exchange has no TorchRec sharded module for the pipeline to split
        self.pipelined = (pipelined(device) if pipeline is None else pipeline) and config.towers is None
        self._pipeline: Any = None  # the TrainPipelineSparseDist, built at the first pipelined step
        self._feeder: BatchFeeder | None = None
        self.embedding_optimizer = config.embedding_optimizer(grid.num_groups)
        fused = self.embedding_optimizer.fused_params()
        if config.towers is not None:  # DMT: recgrid's own tower exchange (engine.sptt)
            from recgrid.engine.sptt import shard_tower_model
            from recgrid.engine.towers import tower_plan

            self.plan = plan if plan is not None else tower_plan(config.spec, config.model, config.towers, grid,
                                                                 device.type)
            self.model = shard_tower_model(config.spec, config.model, config.towers, grid, groups, device, fused,
                                           self.plan, config.seed)
        else:
            model = build_model(config.spec, config.model, seed=config.seed, dense_device=device)
            self.plan = agree_on_plan(plan, model, grid, groups, device.type, fused, config.sharding)
            self.model = shard_model(model, grid, groups, device, fused, self.plan)
        self.dense_names, dense = zip(*dense_named_parameters(self.model))
        self.dense_optimizer = dense_optimizer(config.dense_optimizer, dense, config.dense_lr)
        self.state = TrainerState()
        self.replica_sync = ReplicaSync(self.model, groups.replica_pg, grid.num_groups, config.sync_every,
                                        config.delayed_moment_sync, state=self.state.sync)
        # sharding groups initialise their shards independently: start from one copy
        self.replica_sync.align()
        self.metrics = TrainMetrics(window_steps=ne_window_steps, device=device, imbalance_phase="lookup_kernel",
                                    deferred=self.pipelined)
        attach_lookup_timers(self.metrics.timer, self.model)
        from recgrid.engine.sptt import exchange_meter

        self.exchange = exchange_meter(self.model, grid, self.rank)  # bytes and world sizes of the exchange
        self._lookup_before = 0.0  # the interval's lookup seconds before the current step

    @classmethod
    def build(cls, grid: Grid, config: EngineConfig, device: torch.device, plan: Any = None,
              ne_window_steps: int = 100, pipeline: bool | None = None) -> "Trainer":
        """Build the grid's process groups and the trainer (the whole default group trains)."""
        groups = grid.build_process_groups(device.type)
        assert groups is not None, "build() is for grids that span the whole default group"
        return cls(grid, groups, config, device, plan, ne_window_steps, pipeline)

    # ---- one step ---------------------------------------------------------------------------------
    def train_step(self, batch: Any) -> StepOutput:
        """Forward, backward (embedding rows are updated in place by the fused optimizer during
        backward; dense gradients are all-reduced over all T workers by DDP), dense optimizer step."""
        t0 = time.perf_counter()
        batch = batch.to(self.device, non_blocking=True)
        self.dense_optimizer.zero_grad(set_to_none=True)
        loss, (_, logits, labels) = self._forward(batch)
        loss.backward()
        self.dense_optimizer.step()
        synchronize(self.device)
        return StepOutput(loss=loss.detach(), logits=logits, labels=labels, seconds=time.perf_counter() - t0)

    def _forward(self, batch: Any) -> Any:
        """The model's forward in this trainer's precision (bf16 autocast on CUDA if asked)."""
        with autocast(self.device, self.precision):
            return self.model(batch)

    def _step(self, batch: Any, wait: float) -> StepOutput:
        """One step of the loop: train, count, sync if due, and charge the phases."""
        timer = self.metrics.timer
        timer.add("data_wait", wait)
        out = self.train_step(batch)
        self.state.step += 1
        self.state.examples += int(out.labels.numel()) * self.grid.world_size
        record = self.replica_sync.maybe_sync(self.state.step)
        self.state.sync.settle()  # CUDA events of the plain loop's sync (nothing to read on CPU)
        timer.add("sync", record.seconds if record else 0.0)
        # the lookup hooks fired inside this step's compute; the rest of it is the dense part
        timer.add("dense", max(0.0, out.seconds - timer.seconds["lookup"] + self._lookup_before))
        return out

    @property
    def at_sync_point(self) -> bool:
        """Whether the last step ended a sync interval (the replicas are identical after it)."""
        return self.state.step % self.config.sync_every == 0

    # ---- steps: the plain loop and the pipelined one -----------------------------------------------
    def _steps(self, batches: Iterator[Any], n: int) -> Iterator[tuple[StepOutput, Any]]:
        """Take up to `n` steps on `batches`, yielding `(output, the batch it trained)` after each
        step's replica sync; the caller's work between two yields (metrics, hooks, snapshots,
        evaluation) happens between two steps. Reads at most `n` batches from `batches`."""
        return self._pipelined_steps(batches, n) if self.pipelined else self._plain_steps(batches, n)

    def _plain_steps(self, batches: Iterator[Any], n: int) -> Iterator[tuple[StepOutput, Any]]:
        for _ in range(n):
            t0 = time.perf_counter()
            batch = next(batches, None)
            if batch is None:
                return
            self._lookup_before = self.metrics.timer.seconds["lookup"]
            yield self._step(batch, time.perf_counter() - t0), batch

    def _pipelined_steps(self, batches: Iterator[Any], n: int) -> Iterator[tuple[StepOutput, Any]]:
        """Steps through TorchRec's TrainPipelineSparseDist. The pipeline reads from a
        `BatchFeeder` of exactly the `n` batches to train (it never reads past them), and one
        step is one output of `progress()`, counted when it comes out."""
        timer = self.metrics.timer
        self._feeder = feeder = BatchFeeder(itertools.islice(batches, n), timer)
        try:
            for _ in range(n):
                pipe = self._pipeline if self._pipeline is not None else self._new_pipeline()
                feeder.prefetch(3 - len(pipe.batches))  # what this progress() reads: data wait, before the step
                if feeder.drained and not pipe.batches:
                    return
                t0 = time.perf_counter()
                timer.start("dense")  # the step's device time; the lookup spans inside are netted out
                _, logits, labels = output = pipe.progress(feeder)
                timer.stop("dense")
                batch = feeder.trained()
                self.state.step += 1
                self.state.examples += int(labels.numel()) * self.grid.world_size
                if self.replica_sync.due(self.state.step):
                    with timer.phase("sync"):
                        self.replica_sync.sync(self.state.step)
                # seconds: the host's time to issue the step; its device time is in the phase timer
                yield StepOutput(loss=output[0], logits=logits, labels=labels, seconds=time.perf_counter() - t0), batch
        finally:
            if self._feeder is feeder:
                self._drop_pipeline()
                self._feeder = None

    def _new_pipeline(self) -> Any:
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        # recgrid syncs replicas itself (dmp_collection_sync_interval_batches=None: TorchRec's
        # sync is DMPCollection's); the forward runs in the trainer's precision
        self._pipeline = TrainPipelineSparseDist(self.model, self.dense_optimizer, self.device,
                                                 execute_all_batches=True, custom_model_fwd=self._forward,
                                                 dmp_collection_sync_interval_batches=None)
        return self._pipeline

    def _drop_pipeline(self, refeed: bool = False) -> None:
        """Give the model its own forwards back and forget the pipeline. With `refeed`, the batches
        it had prefetched are fed again to the next pipeline, first (an evaluation in the middle
        of a segment); otherwise they are dropped (a restore, the end of training)."""
        if self._pipeline is None:
            return
        self._pipeline.detach()
        self._pipeline = None
        if self._feeder is not None:
            if refeed:
                self._feeder.refeed()
            else:
                self._feeder.drop()

    # ---- loops --------------------------------------------------------------------------------------
    def run(self, batches: Iterator[Any], max_steps: int) -> LoopResult:
        """Train until `max_steps` finished steps or the batches run out, on batches the caller
        provides (benchmarks, tests, `recgrid smoke`); no data cursor, logging or evaluation.
        Reads at most the batches it trains (so a caller may go on with the same iterator)."""
        result = LoopResult(steps=0, phase_seconds={p: 0.0 for p in self.metrics.timer.phases})
        t_start = time.perf_counter()
        laps, losses, compute = [], [], []
        steps = self._steps(iter(batches), max(0, max_steps - self.state.step))
        for out, _ in steps:
            laps.append(self.metrics.timer.lap())  # read after the loop: no device wait per step
            losses.append(out.loss)
            compute.append(out.seconds)
        steps.close()
        for lap, seconds_of_step in zip(laps, compute):
            seconds = lap.seconds()
            if self.pipelined:  # the device's time of the step (out.seconds is the host's, to issue it)
                seconds_of_step = seconds["lookup"] + seconds["dense"]
            result.step_seconds.append(seconds_of_step + seconds["sync"])
            for phase, s in seconds.items():
                result.phase_seconds[phase] += s
        result.losses = torch.stack(losses).float().cpu().tolist() if losses else []
        result.steps = len(result.step_seconds)
        result.examples = self.state.examples
        result.wall_seconds = time.perf_counter() - t_start
        return result

    def fit(self, data: TrainData, loop: LoopConfig, eval_data: EvalData | None = None,
            hooks: FitHooks | None = None) -> dict[str, float]:
        """Train from the current state to `loop.max_steps`, epoch after epoch of `data`.

        Every `log_every` steps (and at the end) the workers' metrics are reduced over all T and
        handed to `hooks.on_log` on every worker; evaluation runs every `eval_every` steps and at
        the end; `hooks.at_sync_point` runs every K steps. Returns the last metrics.
        """
        hooks = hooks or FitHooks()
        last: dict[str, float] = {}
        st = self.state

        def log(values: dict[str, float]) -> None:
            last.update(values)
            if hooks.on_log is not None:
                hooks.on_log(values, st.step)

        def run_eval() -> None:
            if eval_data is not None and st.evaluated_at != st.step:
                log(self.evaluate(eval_data))
                st.evaluated_at = st.step

        self.metrics.reset_interval()
        stop = False
        while st.step < loop.max_steps and not stop:
            steps_left, batches = data.segment_batches(st.cursor)
            take = min(steps_left, loop.max_steps - st.step)
            done = 0
            steps = self._steps(batches, take)
            for out, batch in steps:  # one trained step each (the pipelined loop reads ahead)
                st.cursor.steps += 1
                self.metrics.update(torch.sigmoid(out.logits.float()), out.labels, out.loss)
                if hooks.on_step is not None:
                    hooks.on_step(self, out, batch)
                if self.at_sync_point and hooks.at_sync_point is not None:
                    hooks.at_sync_point(self)
                done += 1
                if st.step % loop.log_every == 0 or st.step == loop.max_steps:
                    values = reduce_metrics(self.groups.global_pg, train=self.metrics)
                    values.update(self.sync_metrics())
                    values.update(self.exchange.metrics(self.groups.global_pg, self.device))
                    self.metrics.reset_interval()
                    log(values)
                    stop = hooks.stop_requested is not None and hooks.stop_requested(self)
                if loop.eval_every and st.step % loop.eval_every == 0:
                    run_eval()
                if stop:
                    break
            steps.close()  # drops a pipeline still holding prefetched batches
            batches.close()  # stops this worker's Ray Data stream
            if done == steps_left:
                data.plan.next_epoch(st.cursor)
        run_eval()
        last["train/epochs"] = float(st.cursor.epoch)
        return last

    def evaluate(self, data: EvalData) -> dict[str, float]:
        """NE, AUC, log loss over every eval row of every worker (sums reduced, never averages).
        A training pipeline in flight is dropped first (its prefetched batches are fed again to
        the next one): the model gets its own forwards back."""
        self._drop_pipeline(refeed=True)
        evaluation = EvalMetrics(device=self.device)
        self.model.eval()
        try:
            with torch.no_grad():
                for batch, real in lockstep(data.batches(), self.groups.global_pg, self.device):
                    _, (_, logits, labels) = self._forward(batch.to(self.device, non_blocking=True))
                    if real:
                        evaluation.update(torch.sigmoid(logits.float()), labels)
        finally:
            self.model.train()
        return reduce_metrics(self.groups.global_pg, evaluation=evaluation)

    def sync_metrics(self) -> dict[str, float]:
        s = self.state.sync
        s.settle()  # the device time of syncs timed with CUDA events
        return {
            "sync/count": float(s.count),
            "sync/seconds_total": s.seconds,
            "sync/bytes_total": float(s.bytes),
            "sync/seconds_last": s.last.seconds if s.last else 0.0,
            "sync/bytes_last": float(s.last.bytes) if s.last else 0.0,
        }

    def close(self) -> None:
        """Let collectives in flight land (before the process groups go away)."""
        self._drop_pipeline()
        self.replica_sync.close()

    # ---- in-memory snapshots ----------------------------------------------------------------------
    def shard_tensors(self) -> list[torch.Tensor]:
        """This worker's shards, as views of the kernels' storage: weights, optimizer states, and
        the delayed moment sync's average in flight (once it has landed)."""
        pending = self.state.sync.pending
        extra: list[torch.Tensor] = []
        if pending is not None:
            pending.settle()
            extra = pending.snapshot + pending.averaged
        return embedding_weights(self.model) + optimizer_states(self.model) + extra

    def snapshot(self) -> Snapshot:
        """A copy of this worker's share of the state (collective: the NE window is summed)."""
        return Snapshot(shard=[t.detach().to("cpu", copy=True) for t in self.shard_tensors()],
                        dense=self.dense_state(), progress=self.state.progress(),
                        window=self.metrics.window_state(self.groups.global_pg))

    def restore(self, shard: list[torch.Tensor], dense: dict[str, torch.Tensor], progress: dict[str, Any],
                window: torch.Tensor | None) -> None:
        """Load a snapshot taken by any worker of the same shard position (its own, or a replica
        peer's), with the job's progress: the inverse of `snapshot`. `window` is the NE window
        summed over the workers (global rank 0 keeps it; None: start a fresh window)."""
        states = optimizer_states(self.model)
        kernel = embedding_weights(self.model) + states
        if len(shard) not in (len(kernel), len(kernel) + 2 * len(states)):
            raise RuntimeError(f"snapshot holds {len(shard)} shard tensors; this worker's shards need {len(kernel)}")
        with torch.no_grad():
            for dst, src in zip(kernel, shard):
                if dst.shape != src.shape:
                    raise RuntimeError(f"snapshot shard of shape {tuple(src.shape)} does not fit {tuple(dst.shape)}: "
                                       f"it was taken with another sharding plan")
                dst.copy_(src)
        rest = shard[len(kernel):]
        self._drop_pipeline()  # batches it prefetched follow the old cursor
        self.state.sync.pending = None
        if rest and self.config.delayed_moment_sync:
            n = len(states)
            self.state.sync.pending = PendingAverage([t.to(self.device).clone() for t in rest[:n]],
                                                     [t.to(self.device).clone() for t in rest[n:]])
        self.load_dense_state(dense)
        self.state.load_progress(progress)
        self._load_window(window)

    # ---- dense part -----------------------------------------------------------------------------------
    def dense_state(self) -> dict[str, torch.Tensor]:
        """Dense parameters and the dense optimizer's state by name, as CPU copies (the same on
        every worker: DDP keeps them identical)."""
        out = {f"param/{n}": p.detach().to("cpu", copy=True) for n, p in zip(self.dense_names, self._dense_params())}
        for n, p in zip(self.dense_names, self._dense_params()):
            for k, v in self.dense_optimizer.state.get(p, {}).items():
                if torch.is_tensor(v):
                    out[f"optim/{n}/{k}"] = v.detach().to("cpu", copy=True)
        return out

    def load_dense_state(self, dense: dict[str, torch.Tensor]) -> None:
        self._init_dense_optimizer_state()
        with torch.no_grad():
            for n, p in zip(self.dense_names, self._dense_params()):
                p.copy_(dense[f"param/{n}"])
                for k, v in self.dense_optimizer.state[p].items():
                    if torch.is_tensor(v):
                        v.copy_(dense[f"optim/{n}/{k}"])

    def _dense_params(self) -> list[torch.nn.Parameter]:
        return [p for group in self.dense_optimizer.param_groups for p in group["params"]]

    def _init_dense_optimizer_state(self) -> None:
        """Give every dense parameter its optimizer state (Adam creates it at the first step), so
        a restore has tensors to load into: one step with zero gradients and zero learning rate."""
        params = self._dense_params()
        if all(self.dense_optimizer.state.get(p) for p in params) or self.config.dense_optimizer == "sgd":
            return
        lrs = [g["lr"] for g in self.dense_optimizer.param_groups]
        for g in self.dense_optimizer.param_groups:
            g["lr"] = 0.0
        for p in params:
            p.grad = torch.zeros_like(p)
        self.dense_optimizer.step()
        for g, lr in zip(self.dense_optimizer.param_groups, lrs):
            g["lr"] = lr
        self.dense_optimizer.zero_grad(set_to_none=True)

    def _load_window(self, window: torch.Tensor | None) -> None:
        keep = self.rank == 0  # the summed window and all examples on one worker: the reduced sums are right
        self.metrics.load_window_state(window, steps=self.state.step, keep=keep and window is not None)
        self.metrics.examples_total = self.state.examples if keep else 0

    # ---- storage checkpoints (Stateful) ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything that must survive, for `torch.distributed.checkpoint` (collective: the NE
        window is summed over all workers). Embedding tables and their optimizer states are the
        DMP's DTensors, so a checkpoint loads into another M or L (DCP reshards); a delayed
        moment sync's average in flight is not kept (the next sync starts a new one)."""
        self._init_dense_optimizer_state()
        return {
            "model": self.model.state_dict(),
            "embedding_optimizer": self.model.fused_optimizer.state_dict(),
            "dense_optimizer": {k: v for k, v in self.dense_state().items() if k.startswith("optim/")},
            "window": self.metrics.window_state(self.groups.global_pg),
            "progress": json.dumps(self.state.progress()),
            "plan": json.dumps(plan_record(self.plan)),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._drop_pipeline()  # batches it prefetched follow the old cursor
        self.model.load_state_dict(sd["model"])
        self.model.fused_optimizer.load_state_dict(sd["embedding_optimizer"])
        dense = dict(sd["dense_optimizer"])
        dense.update({f"param/{n}": p for n, p in zip(self.dense_names, self._dense_params())})
        self.load_dense_state(dense)
        self.state.sync.pending = None
        self.state.load_progress(json.loads(sd["progress"]))
        self._load_window(sd["window"])


class BatchFeeder:
    """What the training pipeline reads from: a worker's batches, pulled from `source` with the
    wait charged to the "data_wait" phase, and every batch handed to the pipeline kept until its
    step is trained (in order: the pipeline trains first in, first out).

    `prefetch(n)` pulls ahead before a step opens, so the step's span holds no wait for data;
    `trained()` gives the batch of the output that just came out; `refeed()` puts the batches a
    dropped pipeline held back in front (they are read again, by the next pipeline); `drop()`
    forgets them (a restore, or training ends: the cursor counts only trained batches).
    """

    def __init__(self, source: Iterator[Any], timer: Any) -> None:
        self._source, self._timer = source, timer
        self._ready: deque = deque()  # pulled, not yet handed to the pipeline
        self._in_flight: deque = deque()  # handed to the pipeline, not yet trained
        self._exhausted = False

    @property
    def drained(self) -> bool:
        """No batch left to hand out."""
        return self._exhausted and not self._ready

    def prefetch(self, n: int) -> None:
        t0 = time.perf_counter()
        while len(self._ready) < n and not self._exhausted:
            batch = next(self._source, None)
            if batch is None:
                self._exhausted = True
            else:
                self._ready.append(batch)
        self._timer.add("data_wait", time.perf_counter() - t0)

    def __iter__(self) -> "BatchFeeder":
        return self

    def __next__(self) -> Any:
        if not self._ready:
            self.prefetch(1)
        if not self._ready:
            raise StopIteration
        batch = self._ready.popleft()
        self._in_flight.append(batch)
        return batch

    def trained(self) -> Any:
        return self._in_flight.popleft()

    def refeed(self) -> None:
        self._ready.extendleft(reversed(self._in_flight))
        self._in_flight.clear()

    def drop(self) -> None:
        self._ready.clear()
        self._in_flight.clear()


def lockstep(batches: Iterator[Any], group: dist.ProcessGroup, device: torch.device) -> Iterator[tuple[Any, bool]]:
    """Yield `(batch, real)` the same number of times on every worker of `group`, until every
    worker's batches end; a worker already done gets its last batch again, marked not real.

    Every forward pass is collective (all-to-all inside the sharding group, DDP over all T), so
    workers must agree on how many they take (evaluation parts differ by up to a batch).
    """
    last = None
    it = iter(batches)
    while True:
        batch = next(it, None)
        flag = torch.tensor([0 if batch is None else 1], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if int(flag) == 0:
            return
        if batch is not None:
            last = batch
            yield batch, True
        else:
            if last is None:
                raise RuntimeError("this worker got no evaluation rows while others did; use fewer workers or more eval rows")
            yield last, False


def attach_lookup_timers(timer: Any, model: nn.Module) -> None:
    """Charge the sparse arch's forward to "lookup" and the fused-kernel lookups inside it to
    "lookup_kernel", with forward hooks.

    "lookup" is the id all-to-all, the kernel lookups and the pooled all-to-all; "lookup_kernel"
    is this worker's kernel lookups alone (its share of the work: the lookup-imbalance metric
    compares it across workers, free of the waits inside the all-to-alls).
    """
    from torchrec.models.dlrm import SparseArch

    def hook(module: nn.Module, phase: str) -> None:
        def stop(*_: Any) -> None:  # a forward hook that returns anything replaces the output
            timer.stop(phase)

        module.register_forward_pre_hook(lambda *_: timer.start(phase))
        module.register_forward_hook(stop)

    for m in model.modules():
        if isinstance(m, SparseArch):
            hook(m, "lookup")
            for sub in m.modules():
                for lookup in getattr(sub, "_lookups", []) or []:
                    hook(lookup, "lookup_kernel")


def dense_named_parameters(model: nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The data-parallel parameters by name. Fused-kernel tables are updated inside backward and
    must not reach the dense optimizer."""
    return [(name, p) for name, p in model.named_parameters()
            if "embedding_bag" not in name and type(p).__name__ != "TableBatchedEmbeddingSlice"]


def dense_parameters(model: nn.Module) -> list[torch.nn.Parameter]:
    return [p for _, p in dense_named_parameters(model)]
