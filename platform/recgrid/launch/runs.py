"""The sharding groups' runs of a Ray job, on the driver: where they go (`placer`, over
`launch.placement`), who owns them (`GroupRuns`, an actor whose end ends them), which run starts,
ends and starts again when a pinned node is gone (`JobRuns`), what the hosts' snapshot holders
keep (`HolderMeter`, `node_room`), and the console the workers speak through (`Console`). The
protocol: docs/design-notes.md, "Failures, restarts and elastic jobs"."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from recgrid.config import JobConfig
from recgrid.launch.placement import host_local_nodes, inter_host_nodes, worker_nodes
from recgrid.launch.report import say
from recgrid.train.control import LazyActor
from recgrid.train.recovery.slots import shm_free

HOLDER_METER_S = 10.0  # how often the driver logs what the hosts' snapshot holders keep
# Ray Train's controller polls its worker group every 2 s by default (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S,
# ray/train/v2/_internal/constants.py DEFAULT_HEALTH_CHECK_INTERVAL_S): a dead worker, and so the restart
# of its sharding group, and the end of every run are seen up to that much later. A poll is one small
# call per worker of the run.
RUN_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}


def worker_resources(config: JobConfig) -> dict[str, float]:
    """The Ray resources each training worker asks for."""
    t = config.train
    return {"CPU": t.cpus_per_worker, **t.resources_per_worker, **({"GPU": 1} if t.use_gpu else {})}


def placer(config: JobConfig) -> Any:
    """How the job's runs are pinned (`JobRuns`): `place(groups, taken)` -> group -> the node of each
    of its shard positions, for the groups `groups` that the alive nodes can take besides `taken`
    (the nodes of the groups still running); host-local places every group at once or none
    (`launch.placement.host_local_nodes`), inter-host each on nodes of its own
    (`launch.placement.inter_host_nodes`). None: the job is not pinned (one node holds workers)."""
    import ray

    grid, per_worker = config.build_grid(), worker_resources(config)
    if len(worker_nodes(ray.nodes(), per_worker)) <= 1:
        return None
    L, M = grid.group_size, grid.num_groups

    def place(groups: list[int], taken: set[str]) -> dict[int, list[str]]:
        if grid.layout == "inter-host":
            return inter_host_nodes(ray.nodes(), per_worker, L, groups, taken)
        nodes_of = host_local_nodes(ray.nodes(), per_worker, L, M)
        return {} if nodes_of is None else {g: [nodes_of[s][g] for s in range(L)] for g in range(M)}

    return place


class JobRuns:
    """The job's M sharding-group runs, and the nodes each is pinned to (`pinned`: group -> the node
    of each of its shard positions; a group not in it runs unpinned, or waits, in `waiting`, for
    nodes). Each run is held by an owner actor (`GroupRuns`) on the driver's node, and ending the
    owner ends its runs (the module docstring): host-local groups share their nodes and are started
    and ended together, under one owner; inter-host groups one owner each.

    `start()` starts every group `place` places now (all of them when the job is not pinned);
    `moved()`, asked every second, answers a pinned node gone: host-local, it held shard position s
    of every group, so every run is ended (their selectors name the dead node: they would wait for
    it forever) and started again, pinned to live nodes where those hold every replica group whole,
    else at once with the lost positions pinned to the node that joins next (`_start_ahead`); their
    workers restore the hosts' in-memory snapshot, else the newest storage checkpoint
    (`train.recovery.storage`); inter-host, only the groups that had a worker there are ended, and
    each is started again on nodes no other group uses once there are (it heals from a live peer).
    Both return the runs they started: (a fit call per run, the event `end()` sets first, so the
    driver tells the runs it ended from failed ones, its group)."""

    def __init__(self, grid: Any, here: Any, place: Any, max_failures: int = 0, make_run: Any = None) -> None:
        self.grid, self.here, self.place, self.make_run = grid, here, place, make_run
        self.max_failures = max_failures  # each run's train.max_failures (its FailureConfig)
        self.pinned: dict[int, list[str]] = {}
        self.unplaced = False  # host-local on several nodes that cannot hold every replica group whole: not pinned
        if place is not None:
            self.pinned = place(list(range(grid.num_groups)), set())
            if grid.layout == "host-local" and len(self.pinned) < grid.num_groups:
                self.place, self.pinned = None, {}  # the nodes cannot hold every replica group whole yet
                self.unplaced = True
        self.waiting: set[int] = set(range(grid.num_groups)) - set(self.pinned) if self.place is not None else set()
        self.running: set[int] = set()
        self.owners: list[tuple[Any, set[int], threading.Event]] = []
        self._said_wait = False
        self._known: set[str] = set()  # the alive nodes when positions were started ahead (`_start_ahead`)
        self.control: Any = None  # the job's JobControl (where each rank's newest worker runs)

    def start_groups(self, placeable: int) -> int:
        """How many sharding groups start now (the first quorum waits for them): the pinned ones, or
        unpinned, the ones the cluster's nodes hold (`placeable`)."""
        return len(self.pinned) if self.place is not None else placeable

    def unpinned_positions(self, per_worker: dict[str, float]) -> dict[int, list[str]]:
        """Where an unpinned job's shard positions are, for its holders' memory: on the one node
        that holds workers ({} where that is unknown: an elastic host-local job not pinned yet)."""
        import ray

        nodes = worker_nodes(ray.nodes(), per_worker)
        if self.place is not None or len(nodes) != 1:
            return {}
        return {0: nodes * self.grid.group_size}

    def start(self) -> list[tuple[Any, threading.Event, int]]:
        groups = sorted(self.pinned) if self.place is not None else list(range(self.grid.num_groups))
        return self._start(groups)

    def _start(self, groups: list[int]) -> list[tuple[Any, threading.Event, int]]:
        import ray

        # the runs' controllers are their owner's children and inherit its environment
        env = {k: v for k, v in RUN_ENV.items() if k not in os.environ}  # a value the driver was given wins
        cohorts = [groups] if self.grid.layout == "host-local" else [[g] for g in groups]
        started = []
        for cohort in cohorts:
            trainers = [self.make_run(g, self.pinned.get(g)) for g in cohort]
            owner = GroupRuns.options(scheduling_strategy=self.here, max_concurrency=len(trainers),
                                      runtime_env={"env_vars": env} if env else None).remote()
            retired = threading.Event()
            self.owners.append((owner, set(cohort), retired))
            started += [((lambda tr=tr, owner=owner: raise_returned(ray.get(owner.fit.remote(tr)))), retired, g)
                        for tr, g in zip(trainers, cohort)]
            self.running |= set(cohort)
            self.waiting -= set(cohort)
        return started

    def moved(self) -> list[tuple[Any, threading.Event, int]]:
        import ray

        if self.place is None:
            return []
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        self._resolve(alive)
        lost = sorted(g for g in self.running if {n for n in self.pinned.get(g, ()) if not _ahead(n)} - alive)
        if lost:
            gone = sorted(n[:12] for g in lost for n in set(self.pinned[g]) - alive)
            if self.grid.layout == "host-local":
                positions = sorted({s for g in lost for s, n in enumerate(self.pinned[g]) if n not in alive})
                say(f"host-local: node(s) {', '.join(sorted(set(gone)))} holding shard position(s) {positions} of every "
                    f"sharding group are gone, and every live copy of those shards with them; the groups' runs are "
                    f"ended and started again on the live nodes, where they restore the hosts' in-memory snapshot "
                    f"(else the newest storage checkpoint)")
                lost = sorted(self.running)
            else:
                say(f"inter-host: node(s) {', '.join(sorted(set(gone)))} of sharding group(s) {lost} are gone; "
                    f"their runs are ended and started again on nodes no other group uses, once there are, and heal "
                    f"from a live peer group; the other groups train on")
            self._end(set(lost))
            self._said_wait = False
        if not self.waiting:
            return []
        held = {n for g in self.running for n in self.pinned.get(g, ())}
        placed = self.place(sorted(self.waiting), held)
        placed = {g: p for g, p in placed.items() if g in self.waiting}
        host_local = self.grid.layout == "host-local"
        if host_local and len(placed) < len(self.waiting) and not self._ahead_open():
            # no live node can take every replica group: every group's run starts now, its lost positions to
            # land on the node that joins next (inter-host groups wait for a node instead: a run started
            # ahead for one that the job's end left waiting kept the next job's node from it, in the tests)
            return self._start_ahead(sorted(self.waiting), alive)
        if not placed or (host_local and len(placed) < len(self.waiting)):
            if not self._said_wait:
                say("host-local: waiting for nodes that hold every replica group whole"
                    if self.grid.layout == "host-local" else
                    f"inter-host: sharding group(s) {sorted(self.waiting)} wait for nodes no other group uses")
                self._said_wait = True
            return []
        self.pinned.update(placed)
        return self._start(sorted(placed))

    def _start_ahead(self, groups: list[int], alive: set[str]) -> list[tuple[Any, threading.Event, int]]:
        """No live node can take `groups`' lost shard positions: their runs start now, their
        positions on live nodes pinned there and the others to a node that is not alive now (`!in(`
        every alive node id `)`), so the controllers and Ray Train's actors start while the job
        waits for a node, and every group's lost position lands on the one node that joins (host-local
        only)."""
        ahead = f"!in({','.join(sorted(alive))})"
        for g in groups:
            self.pinned[g] = [n if n in alive else ahead for n in self.pinned.get(g, [ahead] * self.grid.group_size)]
        self._known = set(alive)
        say(f"{self.grid.layout}: sharding group(s) {groups} start now and wait for a node to replace the lost one")
        return self._start(groups)

    def _ahead_open(self) -> bool:
        """Whether a position started ahead has not yet been seen on a node (`_resolve`)."""
        return any(_ahead(n) for g in self.running for n in self.pinned.get(g, ()))

    def _resolve(self, alive: set[str]) -> None:
        """Name the node that took the positions started ahead (`_start_ahead`), once one has: the
        one node that joined since, or where job control says the positions' new workers run."""
        open_ = [(g, s) for g, ps in self.pinned.items() for s, n in enumerate(ps) if _ahead(n)]
        new = alive - self._known
        if not open_ or not new:
            return
        import ray

        where: dict[int, str] = {}
        if len(new) > 1 and self.control is not None:
            try:
                for a in ray.get(self.control.status.remote(), timeout=10)["attempts"]:
                    where.update({int(r): w["node"] for r, w in a["workers"].items()})
            except Exception:  # noqa: BLE001 - asked again at the next poll
                return
        for g, s in open_:
            node = next(iter(new)) if len(new) == 1 else where.get(self.grid.global_rank(g, s))
            if node in new:
                self.pinned[g][s] = node

    def _end(self, groups: set[int]) -> None:
        """End the owners of `groups` (each owner's runs are retired: not failures)."""
        import ray

        for owner, cohort, retired in list(self.owners):
            if cohort & groups:
                retired.set()
                try:
                    ray.kill(owner)
                except Exception:  # noqa: BLE001 - already gone
                    pass
                self.owners.remove((owner, cohort, retired))
                self.running -= cohort
                self.waiting |= cohort

    def end(self) -> None:
        """End every run it holds (those ended here are not failures)."""
        self._end(set(self.running))
        self.waiting.clear()


def _ahead(position: str) -> bool:
    """Whether a pinned position is a selector for a node to come (`JobRuns._start_ahead`), not a node id."""
    return position.startswith("!in(")


class HolderMeter:
    """What the hosts' snapshot holders keep, in the run: `holders/bytes/<host>` per host (every
    HOLDER_METER_S while the job trains, at the newest step, and once at its end) and, at the end,
    `holders/bytes_max`; `peak` is each host's most (the summary's line)."""

    def __init__(self, coordinator: Any, tracker: Any, console: "Console") -> None:
        self.coordinator, self.tracker, self.console = coordinator, tracker, console
        self.peak: dict[str, int] = {}
        self._at = 0.0
        self._step = -1  # the newest step logged at (one value per metric and step)

    def maybe_log(self, final: bool = False) -> None:
        import ray

        step = self.console.last_step or 0
        if not final and (step <= self._step or time.monotonic() - self._at < HOLDER_METER_S):
            return
        self._at = time.monotonic()
        try:
            now = ray.get(self.coordinator.holder_bytes.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - a figure for operators: the job goes on without it
            now = {}
        for node, nbytes in now.items():
            self.peak[node] = max(self.peak.get(node, 0), nbytes)
        values: dict[str, float] = {f"holders/bytes/{node[:12]}": float(b) for node, b in now.items() if b} \
            if step > self._step else {}
        if final and self.peak:
            values["holders/bytes_max"] = float(max(self.peak.values()))
        if values:
            self.tracker.log_metrics(values, max(step, self._step))
        self._step = max(step, self._step)


def node_room(nodes: list[str]) -> dict[str, dict[str, Any]]:
    """Each of `nodes`' room for snapshot holders, read on the node by a task of no CPU (free
    /dev/shm, None without it) and from Ray (its object store's size, its address)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    info = {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}
    probe = ray.remote(num_cpus=0)(shm_free)
    free = ray.get([probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n, soft=False)).remote()
                    for n in nodes], timeout=120)
    return {n: {"shm_free": f, "object_store": info.get(n, {}).get("Resources", {}).get("object_store_memory", 0),
                "address": info.get(n, {}).get("NodeManagerAddress", "?")} for n, f in zip(nodes, free)}


def workers_finishing(control: Any) -> bool:
    """Whether a worker of the writing group is still writing the job's final checkpoint (it noted
    `final_checkpoint` before, and `final_step` once done): each rank's newest start."""
    import ray

    try:
        attempts = ray.get(control.status.remote(), timeout=5)["attempts"]
    except Exception:  # noqa: BLE001 - not known: not waited for
        return False
    newest: dict[Any, dict[str, Any]] = {}
    for a in attempts:
        newest.update(a["workers"])
    return any("final_checkpoint" in w and "final_step" not in w for w in newest.values())


def training_over(control: Any) -> bool:
    import ray

    try:
        return bool(ray.get(control.over.remote(), timeout=5))
    except Exception:  # noqa: BLE001 - asked again at the next poll
        return False


def raise_returned(error: BaseException | None) -> None:
    """`GroupRuns.fit` hands back a run's error as a value (Ray would wrap it): raise it here."""
    if error is not None:
        raise error


class GroupRunsImpl:
    """The owner of a job's sharding-group runs (module docstring): each `fit` call runs one
    Ray Train run to its end and returns its error, if any. Ending this actor ends every run it still
    holds (their controllers are its children)."""

    def fit(self, trainer: Any) -> BaseException | None:
        try:
            trainer.fit()
        except Exception as e:  # noqa: BLE001 - the driver raises it
            return e
        return None


GroupRuns = LazyActor(GroupRunsImpl)


def end_workers() -> None:
    """End every worker of the job now: recgrid's own local cluster is shut down (its raylet takes
    the workers with it); on a cluster that was joined, leaving it ends the driver's job and the
    Ray Train controller and workers it owns."""
    import ray

    ray.shutdown()


class Console:
    """Prints, on the driver, the lines the workers gave job control (`JobControl.say`), and
    hands `record` the attempts' records each time another attempt's workers have all registered
    (the run's grid/ranks.json: `launch.placement.record_ranks`)."""

    def __init__(self, control: Any, record: Any = None) -> None:
        self.control, self.record, self.printed, self.last_step, self.complete = control, record, 0, None, 0

    def pump(self, timeout: float = 5.0) -> None:
        import ray

        try:
            lines, self.last_step, complete, attempts = ray.get(
                self.control.console.remote(self.printed, self.complete), timeout=timeout)
        except Exception:  # noqa: BLE001 - the console never stops a job
            return
        for line in lines:
            print(line, flush=True)
        self.printed += len(lines)
        if attempts is not None and self.record is not None:
            try:
                self.record(attempts)
            except Exception as e:  # noqa: BLE001 - the record is for operators; training goes on without it
                say(f"could not record where the workers run (grid/ranks.json) in the run: {e}")
        self.complete = complete
