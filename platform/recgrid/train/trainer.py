"""One worker's trainer: its runtime handles, the state that must survive, and the one loop.

`Trainer` separates two things, as TorchTitan's trainer does:
- runtime handles, rebuilt on every start: process groups, device, the sharded model wrapper,
  the optimizer objects, the replica sync, the metrics component and its phase timer;
- `TrainerState` (`train.state`), the state that must survive a restart: step, examples, the
  data cursor, the replica sync's counters and in-flight delayed average, the evaluation mark.
The state inventory is one: `snapshot()` gives this worker's share of all of it (`Snapshot`),
and `load_snapshot()` loads one; in-memory copies (`train.recovery.holders`) and torchft's heal
(`train.recovery.peers`) carry exactly that, and `state_dict()` / `load_state_dict()` carry the
same parts for `torch.distributed.checkpoint` (`train.checkpoint`), the shards in the DMP's
sharded form so that DCP can reshard them. The loop never knows which source a restore came from.

`fit` is the one step loop of every path. What differs between a grid in one torch world (the
local launcher, benchmarks) and a sharding group meeting its peers through torchft (every Ray
job) is a component the loop calls (`Replicas`: start of a round, commit, replica sync, metric
reduction, stop agreement; `train.recovery.peers.TorchftReplicas` for torchft). What runs at a
step's end on a cadence of the job's `Schedule` (`train.schedule`: snapshots, storage checkpoints,
heartbeats) is handed in as `FitHooks.after_step`. The sharding plan is the job's, made once and replayed
(`engine.sharding.make_plan`); a trainer built without one agrees on one with its peers.

On CUDA (`engine.device` decides every CPU/GPU difference) steps run through TorchRec's
`TrainPipelineSparseDist` (`train.pipeline`), phases are timed with CUDA events read once per
logging interval, and precision is a config choice; the CPU loop is the plain one, step by step,
timed on the host clock (`pipeline=False` keeps it on CUDA, to compare). How and why:
docs/design-notes.md, "GPUs".
"""

from __future__ import annotations

import itertools
import json
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from recgrid.data.stream import EvalData, TrainData
from recgrid.engine.device import autocast, configure_matmul, pipelined, resolve_precision, synchronize
from recgrid.engine.exchange import exchange_meter
from recgrid.engine.grid import Grid, GridGroups
from recgrid.engine.model import build_model
from recgrid.engine.optimizer import dense_optimizer
from recgrid.engine.sharding import agree_on_plan, plan_record, shard_model
from recgrid.engine.sptt import shard_tower_model
from recgrid.engine.sync import ProcessGroupSum, ReplicaSync, embedding_weights, optimizer_states
from recgrid.engine.towers import tower_plan
from recgrid.train.control import STOP_NOW
from recgrid.train.metrics import EvalMetrics, TrainMetrics, reduce_metrics
from recgrid.train.pipeline import BatchFeeder, RoundCommit
from recgrid.train.schedule import Schedule
from recgrid.train.state import FitHooks, LoopResult, Snapshot, StepOutput, TrainerState
from recgrid.trainer_config import EngineConfig, LoopConfig

class Replicas:
    """How a trainer's steps agree with the other model copies: the part of a step that differs
    between a grid in one torch world and sharding groups meeting through torchft
    (`train.recovery.peers.TorchftReplicas`). This one is the grid's own: every worker in one process group, dense gradients averaged by DDP inside
    backward, the replica sync every K steps over the replica group, metrics reduced and a stop
    agreed over all T workers; every step commits.

    The loop calls, per step: `start_round()` before it reads a batch ("train"; torchft: "reload"
    after a heal replaced the state, "end" when there is nothing left to train), `commit(step)`
    after backward (True: the optimizer steps and the step counts), `sync(step)` after the
    optimizer (seconds spent); per logging interval `reduce(...)` and `agree_stop(flag)`.
    Components that act at sync steps, alike on every worker of a sharding group (a snapshot, a
    storage checkpoint), register their vote with `agree(name, vote)`: `vote(step)` is asked at
    each sync step's commit, and `agreed(name)` says, after it, whether any worker of the group voted yes.
    """

    def __init__(self, trainer: "Trainer") -> None:
        self.trainer = trainer
        self.votes: dict[str, Callable[[int], bool]] = {}
        self._agreed: dict[str, bool] = {}

    rounds_talk = False  # start_round and commit need no peer here (torchft's ask the quorum)

    def agree(self, name: str, vote: Callable[[int], bool]) -> None:
        self.votes[name] = vote

    def agreed(self, name: str) -> bool:
        """Whether the group agreed on `name` at the newest sync step's commit."""
        return self._agreed.get(name, False)

    def _local_votes(self, step: int) -> dict[str, bool]:
        """This worker's votes at `step` (a sync step), and none between them."""
        ends_block = self.trainer.schedule.syncs(step)
        return {name: ends_block and bool(vote(step)) for name, vote in self.votes.items()}

    def start_round(self) -> str:
        return "train"

    def commit(self, step: int) -> bool:
        """Every step commits; the votes need no agreement here (one process group decides alike
        only where every worker's vote is the same: the grid's own components vote by step)."""
        self._agreed = self._local_votes(step)
        return True

    def sync(self, step: int) -> float:
        t = self.trainer
        record = t.replica_sync.maybe_sync(step)
        t.state.sync.settle()  # CUDA events of the plain loop's sync (nothing to read on CPU)
        return record.seconds if record else 0.0

    @property
    def workers(self) -> int:
        """How many workers trained the step (the examples it counts are batch x this)."""
        return self.trainer.grid.world_size

    def reduce(self, **states: Any) -> dict[str, float]:
        return reduce_metrics(self.trainer.groups.global_pg, **states)

    def agree_stop(self, mine: int) -> int:
        """Global rank 0's stop code, told to every worker."""
        box = [int(mine) if self.trainer.rank == 0 else None]
        dist.broadcast_object_list(box, group=self.trainer.groups.global_pg, group_src=0)
        return int(box[0])

    def evaluates(self) -> bool:
        """Whether this worker takes part in evaluations (every worker of the grid does)."""
        return True


class Trainer:
    """One worker's part of the 2-D engine and its training state (see the module docstring).

    Building it is collective: every worker of `groups.global_pg` builds one. `pipeline` picks
    the loop: None = the device's (`engine.device.pipelined`: TorchRec's TrainPipelineSparseDist
    on CUDA, the plain loop on CPU); True or False to compare the two (the pipelined loop also
    runs on CPU with gloo, without streams to overlap on: tests check its step accounting there).
    `schedule` is the job's (`Schedule.of_job`); None = K's alone (`config.sync_every`).
    """

    def __init__(self, grid: Grid, groups: GridGroups, config: EngineConfig, device: torch.device,
                 plan: Any = None, pipeline: bool | None = None, schedule: Schedule | None = None) -> None:
        self.grid, self.groups, self.config, self.device = grid, groups, config, device
        self.schedule = schedule if schedule is not None else Schedule(config.sync_every)
        if self.schedule.sync_every != config.sync_every:
            raise ValueError(f"the schedule's K={self.schedule.sync_every} is not the engine's "
                             f"sync_every={config.sync_every}")
        self.rank = groups.coords.rank
        self.precision = resolve_precision(device, config.precision)
        configure_matmul(device, self.precision)  # before any kernel runs; refuses tf32/bf16 off CUDA
        # recgrid's own tower exchange has no TorchRec sharded module for the pipeline to split
        self.pipelined = (pipelined(device) if pipeline is None else pipeline) and config.towers is None
        self._pipeline: Any = None  # the TrainPipelineSparseDist, built at the first pipelined step
        self._feeder: BatchFeeder | None = None
        self._commit: RoundCommit | None = None  # the pipelined loop's optimizer step (`_pipelined_steps`)
        self.embedding_optimizer = config.embedding_optimizer(grid.num_groups)
        fused = self.embedding_optimizer.fused_params()
        if config.towers is not None:  # DMT: recgrid's own tower exchange (engine.sptt)
            self.plan = plan if plan is not None else tower_plan(config.spec, config.model, config.towers, grid,
                                                                 device.type)
            self.model = shard_tower_model(config.spec, config.model, config.towers, grid, groups, device, fused,
                                           self.plan, config.seed)
        else:
            model = build_model(config.spec, config.model, seed=config.seed, dense_device=device)
            self.plan = agree_on_plan(plan, model, grid, groups, device.type, fused, config.sharding)
            self.model = shard_model(model, grid, groups, device, fused, self.plan, config.row_wise_exchange)
        self.dense_names, dense = zip(*dense_named_parameters(self.model))
        self.dense_optimizer = dense_optimizer(config.dense_optimizer, dense, config.dense_lr)
        self.state = TrainerState()
        self.replica_sync = ReplicaSync.of_model(self.model, ProcessGroupSum(groups.replica_pg, grid.num_groups),
                                                 self.schedule.sync_every, delayed_moment_sync=config.delayed_moment_sync,
                                                 state=self.state.sync)
        # sharding groups initialise their shards independently: start from one copy
        self.replica_sync.align()
        self.metrics = TrainMetrics(window_steps=config.ne_window_steps, device=device, imbalance_phase="lookup_kernel",
                                    deferred=self.pipelined)
        attach_lookup_timers(self.metrics.timer, self.model)
        self.exchange = exchange_meter(self.model, grid, self.rank)  # bytes and world sizes of the exchange
        self._lookup_before = 0.0  # the interval's lookup seconds before the current step
        self.replicas: Replicas = Replicas(self)  # torchft's replaces it (train.recovery.peers)
        self._interrupted: str | None = None  # why a step generator stopped early: "reload" (a heal) or "end"
        self.interrupted = False  # the last fit ended at an interrupt (STOP_NOW): no final evaluation
        self._round_open = False  # a round was started and interrupted by its heal: the next batch continues it

    @classmethod
    def build(cls, grid: Grid, config: EngineConfig, device: torch.device, plan: Any = None,
              pipeline: bool | None = None, schedule: Schedule | None = None) -> "Trainer":
        """Build the grid's process groups and the trainer (the whole default group trains)."""
        groups = grid.build_process_groups(device.type)
        assert groups is not None, "build() is for grids that span the whole default group"
        return cls(grid, groups, config, device, plan, pipeline, schedule)

    # ---- one step ---------------------------------------------------------------------------------
    def train_step(self, batch: Any) -> StepOutput:
        """Forward, backward (embedding rows are updated in place by the fused optimizer during
        backward; dense gradients are all-reduced over all T workers by DDP), the replicas'
        commit, and the dense optimizer step if it commits. `seconds` leaves out the commit's."""
        t0 = time.perf_counter()
        batch = batch.to(self.device, non_blocking=True)
        self.dense_optimizer.zero_grad(set_to_none=True)
        loss, (_, logits, labels) = self._forward(batch)
        loss.backward()
        step = self.state.step + 1
        t1 = time.perf_counter()
        committed = self.replicas.commit(step)
        commit_s = time.perf_counter() - t1
        if committed:
            self.dense_optimizer.step()
        synchronize(self.device)
        return StepOutput(loss=loss.detach(), logits=logits, labels=labels,
                          seconds=time.perf_counter() - t0 - commit_s, step=step, committed=committed)

    def _forward(self, batch: Any, training: bool = True) -> Any:
        """The model's forward in this trainer's precision: a training forward under bf16
        autocast on CUDA if asked; an evaluation forward (`training` false) never autocast, so
        predictions keep float32 (`engine.device.autocast`)."""
        with autocast(self.device, self.precision, training):
            return self.model(batch)

    def _step(self, batch: Any, wait: float, round_s: float) -> StepOutput:
        """One step of the loop: train, count, sync if due, and charge the phases (`round_s`:
        the replicas' start of the round, charged to "sync" with the commit and the sync)."""
        timer = self.metrics.timer
        timer.add("data_wait", wait)
        t0 = time.perf_counter()
        out = self.train_step(batch)
        agree_s = time.perf_counter() - t0 - out.seconds
        sync_s = 0.0
        if out.committed:
            self.state.step = out.step
            self.state.examples += int(out.labels.numel()) * self.replicas.workers
            sync_s = self.replicas.sync(out.step)
        # the rounds and the commit are replica work only where they talk to peers (torchft's quorum);
        # the grid's own are no-ops, and M = 1 charges no sync at all
        timer.add("sync", sync_s + (round_s + agree_s if self.replicas.rounds_talk else 0.0))
        # the lookup hooks fired inside this step's compute; the rest of it is the dense part
        timer.add("dense", max(0.0, out.seconds - timer.seconds["lookup"] + self._lookup_before))
        return out

    # ---- steps: the plain loop and the pipelined one -----------------------------------------------
    def _steps(self, batches: Iterator[Any], n: int,
               on_batch: Callable[["Trainer", int, Any], None] | None = None) -> Iterator[tuple[StepOutput, Any]]:
        """Take up to `n` steps on `batches`, yielding `(output, the batch it trained)` after each
        step's replica sync; the caller's work between two yields (metrics, hooks, snapshots,
        evaluation) happens between two steps. Reads at most `n` batches from `batches`."""
        if self.pipelined:
            return self._pipelined_steps(batches, n, on_batch)
        return self._plain_steps(batches, n, on_batch)

    def _start_round(self) -> float | None:
        """Start the next round (`Replicas.start_round`); its seconds, or None when the loop stops
        (the reason in `_interrupted`: "reload" after a heal replaced the state, "end")."""
        t0 = time.perf_counter()
        # a round a heal interrupted is still open: it goes on with the restored data, no new round
        start = "train" if self._round_open else self.replicas.start_round()
        self._round_open = start == "reload"
        if start != "train":
            self._interrupted = start
            return None
        return time.perf_counter() - t0

    def _plain_steps(self, batches: Iterator[Any], n: int,
                     on_batch: Callable[["Trainer", int, Any], None] | None) -> Iterator[tuple[StepOutput, Any]]:
        """Up to `n` batches, one round each; a round that does not commit (torchft) consumes its
        batch without a step. Stops early, saying why in `_interrupted`, when the replicas' start of a round
        replaced the state (a heal: the data resumes at the restored cursor), or when they say
        there is nothing left to train."""
        for _ in range(n):
            round_s = self._start_round()
            if round_s is None:
                return
            t0 = time.perf_counter()
            batch = next(batches, None)
            if batch is None:
                return
            if on_batch is not None:  # before the round commits (`FitHooks.on_batch`)
                on_batch(self, self.state.step + 1, batch)
            self._lookup_before = self.metrics.timer.seconds["lookup"]
            yield self._step(batch, time.perf_counter() - t0, round_s), batch

    def _pipelined_steps(self, batches: Iterator[Any], n: int,
                         on_batch: Callable[["Trainer", int, Any], None] | None) -> Iterator[tuple[StepOutput, Any]]:
        """Steps through TorchRec's TrainPipelineSparseDist. The pipeline reads from a
        `BatchFeeder` of exactly the `n` batches to train (it never reads past them), and one
        round is one output of `progress()`, counted when it comes out. Rounds start and commit as
        in the plain loop (`Replicas`): the round starts before `progress()`, and the pipeline's
        optimizer step is the round's commit (`RoundCommit`), so a round that does not commit
        consumes its batch without a step; a heal or an end stops the loop as in the plain one."""
        timer = self.metrics.timer
        self._feeder = feeder = BatchFeeder(itertools.islice(batches, n), timer)
        self._commit = commit = RoundCommit(self, feeder, on_batch)
        try:
            for _ in range(n):
                round_s = self._start_round()
                if round_s is None:
                    return
                pipe = self._pipeline if self._pipeline is not None else self._new_pipeline()
                feeder.prefetch(3 - len(pipe.batches))  # what this progress() reads: data wait, before the step
                if feeder.drained and not pipe.batches:
                    return
                t0 = time.perf_counter()
                timer.start("dense")  # the step's device time; the lookup spans inside are netted out
                _, logits, labels = output = pipe.progress(feeder)
                timer.stop("dense")
                batch = feeder.trained()
                if commit.committed:
                    self.state.step += 1
                    self.state.examples += int(labels.numel()) * self.replicas.workers
                    if self.replica_sync.enabled and not self.replicas.rounds_talk:  # the grid's own, timed on the device
                        if self.replica_sync.due(self.state.step):
                            with timer.phase("sync"):
                                self.replica_sync.sync(self.state.step)
                    else:  # the replica component's (torchft: its table average and its listener), as the plain loop
                        sync_s = self.replicas.sync(self.state.step)
                        if self.replicas.rounds_talk:  # the round's quorum and commit talked to peers
                            timer.add("sync", round_s + commit.seconds + sync_s)
                # seconds: the host's time to issue the step; its device time is in the phase timer
                yield StepOutput(loss=output[0], logits=logits, labels=labels,
                                 seconds=time.perf_counter() - t0 - commit.seconds,
                                 step=self.state.step if commit.committed else self.state.step + 1,
                                 committed=commit.committed), batch
        finally:
            if self._feeder is feeder:
                self._drop_pipeline()
                self._feeder = None

    def _new_pipeline(self) -> Any:
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        # recgrid syncs replicas itself (dmp_collection_sync_interval_batches=None: TorchRec's
        # sync is DMPCollection's); the forward runs in the trainer's precision; the optimizer
        # step is the round's commit (`RoundCommit`)
        self._pipeline = TrainPipelineSparseDist(self.model, self._commit, self.device,
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
            if not out.committed:
                continue
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
        """Train from the current state to `loop.max_steps`, epoch after epoch of `data`: the one
        step loop of every path (plain, pipelined, torchft: `self.replicas` decides what differs).

        Every `log_every` steps (and at the end) the workers' metrics are reduced
        (`Replicas.reduce`) and handed to `hooks.on_log`; evaluation runs every `eval_every` steps
        and at the end; `hooks.after_step` runs after every committed step. Returns the last metrics.
        """
        hooks = hooks or FitHooks()
        last: dict[str, float] = {}
        st = self.state

        def log(values: dict[str, float]) -> None:
            last.update(values)
            if hooks.on_log is not None:
                hooks.on_log(values, st.step)

        def run_eval() -> None:
            if eval_data is not None and st.evaluated_at != st.step and self.replicas.evaluates():
                log(self.evaluate(eval_data))
                st.evaluated_at = st.step

        self.metrics.reset_interval()
        self.interrupted = False
        schedule = self.schedule
        stop = 0
        while st.step < loop.max_steps and not stop:
            steps_left, batches = data.segment_batches(st.cursor)
            start = st.cursor.steps
            self._interrupted = None
            steps = self._steps(batches, min(steps_left, loop.max_steps - st.step), hooks.on_batch)
            for out, batch in steps:  # one consumed batch each (the pipelined loop reads ahead)
                st.cursor.steps += 1
                self.metrics.update(torch.sigmoid(out.logits.float()), out.labels, out.loss)
                if hooks.on_step is not None:
                    hooks.on_step(self, out, batch)
                if not out.committed:
                    continue
                for after in hooks.after_step:
                    after(st.step)
                logs = st.step % loop.log_every == 0 or st.step == loop.max_steps
                if logs:
                    values = self.replicas.reduce(train=self.metrics)
                    values.update(self.sync_metrics())
                    values.update(self.exchange.metrics(self.groups.global_pg, self.device))
                    self.metrics.reset_interval()
                    log(values)
                if logs or schedule.checks_stop(st.step):
                    mine = hooks.stop_requested(self) if hooks.stop_requested is not None else 0
                    stop = self.replicas.agree_stop(int(mine))
                    if stop == STOP_NOW and not schedule.syncs(st.step):
                        stop = 0  # an interrupt ends where the replicas were just synced (a checkpoint may follow)
                    elif stop != STOP_NOW and not logs:
                        stop = 0  # a graceful stop waits for a logging step
                    self.interrupted = stop == STOP_NOW
                if loop.eval_every and st.step % loop.eval_every == 0 and not self.interrupted:
                    run_eval()
                if stop or st.step >= loop.max_steps:
                    break
            steps.close()  # drops a pipeline still holding prefetched batches
            batches.close()  # stops this worker's Ray Data stream
            if self._interrupted == "reload":  # a heal replaced the state: the data resumes at its cursor
                continue
            if self._interrupted == "end":  # the replicas say nothing is left to train
                break
            if st.cursor.steps - start == steps_left:
                data.plan.next_epoch(st.cursor)
        if not self.interrupted:
            run_eval()
        last["train/epochs"] = float(st.cursor.epoch)
        return last

    def evaluate(self, data: EvalData) -> dict[str, float]:
        """NE, AUC, log loss over every eval row of every worker (sums reduced, never averages),
        from float32 predictions (no bf16 autocast, whatever the training precision).
        A training pipeline in flight is dropped first (its prefetched batches are fed again to
        the next one): the model gets its own forwards back."""
        self._drop_pipeline(refeed=True)
        evaluation = EvalMetrics(device=self.device)
        self.model.eval()
        try:
            with torch.no_grad():
                for batch, real in lockstep(data.batches(), self.groups.global_pg, self.device):
                    _, (_, logits, labels) = self._forward(batch.to(self.device, non_blocking=True), training=False)
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

    # ---- the state inventory: snapshots (in-memory copies, torchft heals) and storage checkpoints ----
    def shard_tensors(self) -> list[torch.Tensor]:
        """This worker's shards, as views of the kernels' storage: embedding weights, then
        optimizer states. Right after a sync they are the same on every member of a replica group
        (with delayed moment sync, the weights only: each sharding group's states are its own
        until their average lands)."""
        return embedding_weights(self.model) + optimizer_states(self.model)

    def weight_tensor_count(self) -> int:
        """How many of `shard_tensors()` are embedding weights (the first ones)."""
        return len(embedding_weights(self.model))

    def snapshot(self, copy: bool = True) -> Snapshot:
        """This worker's share of the state (no collective): copies on the CPU, or with `copy`
        false views of the live tensors (the caller copies them before the next step)."""
        shard = self.shard_tensors()
        if copy:
            shard = [t.detach().to("cpu", copy=True) for t in shard]
        return Snapshot(shard=shard, dense=self.dense_state(), progress=self.state.progress(),
                        window=self.metrics.own_window())

    def load_snapshot(self, snap: Snapshot, window: torch.Tensor | None) -> None:
        """Load a snapshot taken by any worker of the same shard position (its own, or a replica
        peer's): the inverse of `snapshot`. `window` is the NE window summed over the workers
        (global rank 0 keeps it; None: start a fresh window). A delayed moment sync's average in
        flight is dropped (the state it would correct is replaced)."""
        kernel = self.shard_tensors()
        if len(snap.shard) != len(kernel):
            raise RuntimeError(f"snapshot holds {len(snap.shard)} shard tensors; this worker's shards need {len(kernel)}")
        with torch.no_grad():
            for dst, src in zip(kernel, snap.shard):
                if dst.shape != src.shape:
                    raise RuntimeError(f"snapshot shard of shape {tuple(src.shape)} does not fit {tuple(dst.shape)}: "
                                       f"it was taken with another sharding plan")
                dst.copy_(src)
        self._drop_pipeline()  # batches it prefetched follow the old cursor
        self.replica_sync.drop_pending(settle=True)  # this trainer's own average: landed, then forgotten
        self.load_dense_state(snap.dense)
        self._load_progress(snap.progress, window)

    # ---- dense part -----------------------------------------------------------------------------------
    def dense_state(self) -> dict[str, torch.Tensor]:
        """Dense parameters and the dense optimizer's state by name, as CPU copies (the same on
        every worker: DDP keeps them identical)."""
        out = {f"param/{n}": p.detach().to("cpu", copy=True) for n, p in zip(self.dense_names, self.dense_params())}
        for n, p in zip(self.dense_names, self.dense_params()):
            for k, v in self.dense_optimizer.state.get(p, {}).items():
                if torch.is_tensor(v):
                    out[f"optim/{n}/{k}"] = v.detach().to("cpu", copy=True)
        return out

    def load_dense_state(self, dense: dict[str, torch.Tensor]) -> None:
        self._init_dense_optimizer_state()
        with torch.no_grad():
            for n, p in zip(self.dense_names, self.dense_params()):
                p.copy_(dense[f"param/{n}"])
                for k, v in self.dense_optimizer.state[p].items():
                    if torch.is_tensor(v):
                        v.copy_(dense[f"optim/{n}/{k}"])

    def dense_params(self) -> list[torch.nn.Parameter]:
        """The dense optimizer's parameters (DDP keeps them the same on every worker)."""
        return [p for group in self.dense_optimizer.param_groups for p in group["params"]]

    def _init_dense_optimizer_state(self) -> None:
        """Give every dense parameter its optimizer state (Adam creates it at the first step), so
        a restore has tensors to load into: one step with zero gradients and zero learning rate."""
        params = self.dense_params()
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

    # ---- storage checkpoints (Stateful) ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The snapshot's parts for `torch.distributed.checkpoint` (collective: the NE window is
        summed over all workers): the shards in the DMP's sharded form (the same storage as
        `shard_tensors()`, as DTensors, so a checkpoint loads into another M or L: DCP reshards),
        the dense part (its parameters inside the model's state), the progress and the plan. A
        delayed moment sync's average in flight is not kept (the next sync starts a new one)."""
        self._init_dense_optimizer_state()
        snap = self.snapshot(copy=False)
        compression = self.config.model.compression
        # a compressed model's rows mean its head ids: kept with them (only then: older checkpoints load as they were)
        extra = {"compression": json.dumps(compression.record())} if compression is not None else {}
        return {**extra,
            "model": self.model.state_dict(),
            "embedding_optimizer": self.model.fused_optimizer.state_dict(),
            "dense_optimizer": {k: v for k, v in snap.dense.items() if k.startswith("optim/")},
            "window": self.metrics.window_state(self.groups.global_pg),
            "progress": json.dumps(snap.progress),
            "plan": json.dumps(plan_record(self.plan)),
        }

    def check_compression(self, recorded: str | None) -> None:
        """Refuse a checkpoint whose compression record (`state_dict()["compression"]`, None: none) is
        not this model's: its q, r and h rows would be read for other ids."""
        compression = self.config.model.compression
        if compression is not None and recorded != json.dumps(compression.record()):
            raise ValueError(
                "the storage checkpoint's QR compression (its settings or head-cache ids) is not this job's: its "
                "rows would be read for other ids; resume with the model.compression, qr_* and head_* settings and "
                "the training files of the job that wrote it")

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.check_compression(sd.get("compression"))
        self._drop_pipeline()  # batches it prefetched follow the old cursor
        self.model.load_state_dict(sd["model"])
        self.model.fused_optimizer.load_state_dict(sd["embedding_optimizer"])
        dense = dict(sd["dense_optimizer"])
        dense.update({f"param/{n}": p for n, p in zip(self.dense_names, self.dense_params())})
        self.load_dense_state(dense)
        self.replica_sync.drop_pending()
        self._load_progress(json.loads(sd["progress"]), sd["window"])

    def _load_progress(self, progress: dict[str, Any], window: torch.Tensor | None) -> None:
        self.state.load_progress(progress)
        keep = self.rank == 0  # the summed window and all examples on one worker: the reduced sums are right
        self.metrics.load_window_state(window, steps=self.state.step, keep=keep and window is not None)
        self.metrics.examples_total = self.state.examples if keep else 0


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
