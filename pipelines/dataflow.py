"""The dataflow of a training run on a Dask cluster: collectors keep collecting while the
learner trains, evaluation runs beside both, and the policy lag stays bounded.

Iteration i is C regions (one per collector, region id i*C + c) and one train call on
exactly those regions, which turns learner version i into version i+1. Everything is a
Dask future, and each task names what it needs, so Dask starts it the moment its inputs
exist and the driver never sits on the critical path:

    rollout(i, c)   acts with params of version max(start, i - K)  (K = max_policy_lag)
    write(i, c)     needs rollout(i, c), on the worker that holds it: stores and commits it
    train(i)        needs rollout(i, 0..C-1) (the regions, in memory), write(i-1, ..) (the
                    commits it records) and train(i-1) (one learner, in order); a train
                    that checkpoints also needs write(i, ..), the regions its checkpoint covers
    evaluate(i)     needs the params of version i+1, on a worker beside the learner

So the learner waits when it is ahead (train(i) waits for its regions), collectors wait
when they are more than K versions ahead (rollout(i) waits for version i-K), and an
off-policy learner's updates per env step stay exactly its configured ratio, whatever the
speeds: Reverb's rate limiter, built from the DAG itself. K = 0 is the lock-step schedule,
reproducible bit for bit; K >= 1 overlaps rollout(i) with train(i-1). A region reaches the
learner from the collector's memory while it is written, so the disk is on no one's
critical path. Params travel as futures from the learner's worker to each collector's
worker, once per version.

The driver keeps K + 2 iterations submitted ahead of the learner, reads each train's
metrics as it completes, and emits one row per iteration in order (waiting for an
iteration's evaluation only to emit its row, never to submit more work).

`run_moving` survives the loss of the learner's worker: the learner moves to another worker
from its last checkpoint and the committed replay, and the iterations after the checkpoint
are collected and trained again (their regions rewritten in place, so each stays once).
"""

from __future__ import annotations

import collections
import dataclasses
import operator
import time
from typing import Callable

from distributed import Client, Future, wait

from pipelines import cluster as clusters
from pipelines import stages
from pipelines.config import RunConfig


@dataclasses.dataclass(frozen=True)
class Placement:
    """Which worker runs what."""

    learner: str
    collectors: tuple[str, ...]  # one per collector stream
    evaluator: str

    @classmethod
    def on(cls, client: Client, config: RunConfig) -> "Placement":
        """The learner on a GPU worker where there is one; collectors on the other workers
        (numpy envs on CPU workers), round-robin; evaluation on a worker no collector uses
        where there is one, else beside the last collector, never on the learner's."""
        where = clusters.placement(client, env_backend=stages.env_backend(config))
        learner = where["learner"]
        others = [w for w in where["collectors"] if w != learner] or [learner]
        collectors = tuple(others[c % len(others)] for c in range(config.n_collectors))
        spare = [w for w in others if w not in collectors]
        return cls(learner, collectors, spare[0] if spare else collectors[-1])


class RunStopped(RuntimeError):
    """The run cannot go on (its learner's worker or the scheduler is gone);
    the message says why and how to resume, in one line."""


class LearnerLost(RunStopped):
    """The learner's worker is gone (killed, crashed) while other workers remain: the
    learner can move to one of them (`run_moving`)."""


# how often a wait checks that the run can go on, and how long the learner's worker may stay
# paused by Dask (memory) before the run stops: no wait is unbounded
LIVENESS_S = 2.0
PAUSED_LIMIT_S = 60.0
# how long a cluster that has lost every worker gets for its nannies to start them again
# (each restart imports JAX afresh: seconds, more on a loaded machine) before the run stops
REJOIN_S = 30.0


class Watch:
    """Waits on futures while checking, every LIVENESS_S, that the learner's worker (whose
    tasks are pinned to it, so they would wait for it forever) is alive and not paused."""

    def __init__(self, client: Client, learner: str, run_dir: str):
        self.client, self.learner, self.run_dir = client, learner, run_dir
        self.checked = time.monotonic()
        self.paused_since: float | None = None
        self.last_seen: dict = {}  # the learner worker's info when last seen
        self.doing = "its first task"  # what the learner was doing, for the message

    def wait(self, futures) -> set:
        """The futures of `futures` that are done (at least one)."""
        while True:
            timeout = max(0.05, LIVENESS_S - (time.monotonic() - self.checked))
            try:
                done = wait(futures, timeout=timeout, return_when="FIRST_COMPLETED").done
            except TimeoutError:
                done = set()
            if time.monotonic() - self.checked >= LIVENESS_S:
                self.check()
            if done:
                return done

    def result(self, future: Future):
        """The future's result, checking on the run meanwhile: a finished future's result can
        be lost with its worker before the driver fetches it, and then waits on a recompute
        that may never come (its inputs pinned to a dead learner)."""
        while True:
            self.wait([future])
            try:
                return future.result(timeout=LIVENESS_S)
            except TimeoutError:
                self.check()

    def check(self):
        self.checked = time.monotonic()
        resume = _resume(self.run_dir)
        workers = self._workers()
        info = workers.get(self.learner)
        if info is None:  # (with every other worker, maybe: then it is the likelier cause)
            lost, for_memory = self._lost()
            if not workers and not for_memory:  # all killed at once: nannies may restart them
                workers = self._rejoined()
            if workers and not for_memory:  # a memory restart would only recur elsewhere
                raise LearnerLost(f"{lost} during {self.doing}; {resume}")
            left = "" if workers else " (and no worker is left)"
            raise RunStopped(f"{lost} during {self.doing}{left}; {resume}")
        self.last_seen = info
        if info.get("status") != "paused":
            self.paused_since = None
        elif self.paused_since is None:
            self.paused_since = self.checked
        elif self.checked - self.paused_since >= PAUSED_LIMIT_S:
            raise RunStopped(
                f"the learner's worker {self.learner} was paused by Dask for {PAUSED_LIMIT_S:.0f} s at "
                f"{_memory(info)} during {self.doing}; {_LOWER}, then {resume}")

    def _workers(self) -> dict:
        try:
            return clusters.workers(self.client)
        except Exception as e:  # the comm's own errors, whatever the transport
            raise _unreachable(e, self.run_dir) from None

    def _rejoined(self) -> dict:
        """The workers that joined within REJOIN_S (none: the run cannot go on)."""
        deadline = time.monotonic() + REJOIN_S
        while time.monotonic() < deadline:
            time.sleep(LIVENESS_S / 2)
            workers = self._workers()
            if workers:
                return workers
        return {}

    def _lost(self) -> tuple[str, bool]:
        """What happened to the learner's worker, and whether Dask restarted it for memory."""
        restarts = [event for _, event in self.client.get_events("worker-restart-memory")
                    if event.get("worker") == self.learner]
        if restarts:
            limit = self.last_seen.get("memory_limit")
            return (f"the learner's worker {self.learner} was restarted by Dask for memory "
                    f"({_gib(restarts[-1]['rss'])} used" + (f" of its {_gib(limit)} limit" if limit else "")
                    + f"; {_LOWER})"), True
        if self.last_seen:
            return f"the learner's worker {self.learner} was lost (last seen at {_memory(self.last_seen)})", False
        return f"the learner's worker {self.learner} was lost", False


def _resume(run_dir: str) -> str:
    return f"run the same command again to resume {run_dir} from its last checkpoint"


def _unreachable(error: Exception, run_dir: str) -> RunStopped:
    return RunStopped(f"the Dask scheduler is unreachable ({type(error).__name__}: {error}); "
                      f"{_resume(run_dir)} once it is back")


_LOWER = "lower buffer_transitions, n_seeds or replay_memory_fraction, or give workers more memory"


def _gib(n) -> str:
    return f"{n / 2**30:.1f} GiB"


def _memory(info: dict) -> str:
    used, limit = info.get("metrics", {}).get("memory", 0), info.get("memory_limit")
    return f"{_gib(used)}" + (f" of its {_gib(limit)} memory limit" if limit else " memory")


@dataclasses.dataclass
class _Iteration:
    index: int
    metrics: Future  # the train call's metrics (params stay on the learner's worker)
    writes: list[Future]  # its regions' write results
    # params held until its row is out (`Dataflow._version`): those its rollouts acted with,
    # those it made (its evaluation's), and those of the writes its train call takes. A
    # rollout, write or evaluation lost with its worker is made again from them, never from a
    # recomputed train call (which would rebuild the learner from its checkpoint)
    held: list[Future] = dataclasses.field(default_factory=list)
    written: list[dict] = dataclasses.field(default_factory=list)
    evaluation: Future | None = None
    trained_at: float | None = None
    result: dict | None = None
    evaluated: dict | None = None


class Dataflow:
    """One run's dataflow on `client`, from iteration `start["iteration"]` to the config's end.

    `run(on_row)` returns the rows (one per iteration: env steps, training return, loss,
    updates, env steps/s, updates/s, learner and collector busy fractions, policy lag,
    and the greedy test scores where evaluated) and keeps run-wide totals in `summary()`.
    """

    def __init__(self, client: Client, config: RunConfig, start: dict, placement: Placement,
                 run_began: float | None = None):
        self.client, self.config, self.where = client, config, placement
        self.cfg = config.to_dict()
        self.first = int(start["iteration"])
        self.lag = int(config.max_policy_lag)
        # each version's params, and the learner's result they were taken from (`_version`)
        self.made: dict[int, Future] = {self.first: self._on_learner(stages.policy_params, self.cfg)}
        self.params: dict[int, Future] = {self.first: self._on_learner(_alias, self.made[self.first])}
        # region writes no train call has been given yet, each with the params its rollout
        # acted with (`_version`: a lost write is made again from them)
        self.unpassed: list[tuple[Future, list[Future]]] = []
        self.pending: collections.deque[_Iteration] = collections.deque()
        self.watch = Watch(client, placement.learner, config.run_dir)
        self.waiting: dict[Future, tuple[_Iteration, str]] = {}  # -> (iteration, kind)
        self.next_to_submit = self.trained = self.first  # iterations submitted / trained
        self.stopped_early = False
        self.busy = {"learner": 0.0, "collectors": 0.0, "evaluator": 0.0}
        self.lags: collections.Counter = collections.Counter()
        self.breakdown: collections.Counter = collections.Counter()  # seconds per part
        self.final_eval: dict = {}
        self.began = self.last_trained = time.perf_counter()
        # max_wall_s counts from the run's start, not from a learner move's
        self.run_began = self.began if run_began is None else run_began

    # -------------------------------------------------------------- submitting work

    def _on_learner(self, fn, *args, **kwargs) -> Future:
        return self.client.submit(fn, *args, workers=[self.where.learner], pure=False, **kwargs)

    def _on_collector(self, c: int, i: int, fn, *args) -> Future:
        """Collector c's task of iteration i (it may move when that worker is gone)."""
        return self.client.submit(fn, *args, workers=[self.where.collectors[c]], allow_other_workers=True,
                                  pure=False, retries=2, priority=_collect_priority(i))

    def _submit(self, i: int):
        """Iteration i's collect tasks, its train task and (when due) its evaluation."""
        config, cfg = self.config, self.cfg
        version = max(self.first, i - self.lag)
        env_steps = i * config.steps_per_iteration
        rolled = [self._on_collector(c, i, stages.rollout, cfg, c, i, self.params[version], version, env_steps)
                  for c in range(config.n_collectors)]
        # each region is written where it was made (no copy), beside the collector's rollouts
        writes = [self._on_collector(c, i, stages.write, cfg, r) for c, r in enumerate(rolled)]
        last = i == config.n_iterations - 1
        checkpoint = last or (i + 1) % config.checkpoint_every == 0
        # a train call takes the writes finished by now (their regions are committed: it records
        # the version that first trained on each) and does not wait for the others, so the
        # learner never waits on the disk; a checkpointing call waits for every region it covers.
        # A disk slower than the learner holds the collectors back instead (stages.PENDING_WRITES),
        # and with them the learner: the regions in memory stay bounded
        self.unpassed += [(w, self._version(version)) for w in writes]
        given = lambda write: checkpoint or write.status == "finished"
        passed = [(w, held) for w, held in self.unpassed if given(w)]
        self.unpassed = [(w, held) for w, held in self.unpassed if not given(w)]
        committed = [w for w, _ in passed]
        previous = self.pending[-1].metrics if self.pending else None
        trained = self._on_learner(stages.train, cfg, i, env_steps + config.steps_per_iteration,
                                   checkpoint, rolled, committed, previous, retries=2)
        # the params stay on the learner's worker until a collector or evaluator needs them
        self.made[i + 1] = trained
        self.params[i + 1] = self._on_learner(operator.itemgetter("params"), trained, priority=1)
        metrics = self._on_learner(operator.itemgetter("metrics"), trained, priority=1)
        it = _Iteration(i, metrics, writes, held=[*self._version(version), *self._version(i + 1),
                                                  *(f for _, held in passed for f in held)])
        self._wait(it, "trained", metrics)
        for future in writes:
            self._wait(it, "written", future)
        if last or (i + 1) % config.eval_every == 0:
            # on a collector's worker, after the next iteration's rollout and before the one
            # after: it fills the collector's idle time (at K = 0, while the learner trains),
            # and a collector that is never idle (K >= 1, slow envs) still lets it in
            it.evaluation = self._evaluate(self.params[i + 1], i, priority=_collect_priority(i + 1) - 1)
            self._wait(it, "evaluated", it.evaluation)
        self.pending.append(it)
        # versions no later iteration acts with
        for v in [v for v in self.params if v < max(self.first, i + 1 - self.lag)]:
            del self.params[v], self.made[v]
        self.next_to_submit = i + 1

    def _version(self, v: int) -> list[Future]:
        """What keeps version v's params safe to lose: the params, and the learner's result
        they were taken from. Collectors fetch the params, and Dask's active memory manager
        may then drop the learner's copy, leaving a collector's the only one; lost with that
        collector's worker, the params are taken again from the learner's result, which only
        the learner's worker ever holds. Never released, it is never recomputed: a train call
        run twice would find the learner moved on (or rebuild it from its checkpoint)."""
        return [self.params[v], self.made[v]]

    def _evaluate(self, params, i: int, **kwargs) -> Future:
        return self.client.submit(stages.evaluate, self.cfg, params, i, workers=[self.where.evaluator],
                                  allow_other_workers=True, pure=False, retries=2, **kwargs)

    def _wait(self, it: _Iteration, kind: str, future: Future):
        self.waiting[future] = (it, kind)

    def _fill(self):
        """Keeps K + 2 iterations submitted beyond the last one the learner finished."""
        horizon = min(self.config.n_iterations, self.trained + self.lag + 2)
        while not self.stopped_early and self.next_to_submit < horizon:
            self._submit(self.next_to_submit)

    # ------------------------------------------------------------------- the loop

    def run(self, on_row: Callable[[dict], None] = lambda row: None) -> list[dict]:
        rows: list[dict] = []
        if self.first >= self.config.n_iterations:  # the checkpoint is already at the end
            self.final_eval = self._evaluate_now(self.first - 1)
            return rows
        self._fill()
        try:
            while self.pending:
                self.watch.doing = f"train of iteration {self.trained}"
                for future in self.watch.wait(list(self.waiting)):
                    it, kind = self.waiting.pop(future)
                    if kind == "trained":
                        self._trained(it, self.watch.result(future))
                    elif kind == "written":
                        it.written.append(self.watch.result(future))
                    else:
                        it.evaluated = self.watch.result(future)
                        self.busy["evaluator"] += it.evaluated.pop("evaluate_s", 0.0)
                self._fill()
                while self.pending and self._ready(self.pending[0]):
                    rows.append(self._row(self.pending.popleft()))
                    on_row(rows[-1])
        except BaseException:
            # an error: drop the pending futures, so the cluster runs nothing more of this run
            # once the dataflow is gone. Not Future.cancel: distributed's scheduler then trips an
            # assertion (a screenful of traceback) on cancelled tasks whose dependents no client holds
            self.pending.clear()
            self.params.clear()
            self.made.clear()
            self.waiting.clear()
            self.unpassed = []
            raise
        last = rows[-1]["iteration"] - 1 if rows else None
        if last is not None and "test_win_rate" not in rows[-1]:
            # stopped by the wall-time limit between evaluations: score the last params
            self.final_eval = self._evaluate_now(last)
            self._attach(rows[-1], self.final_eval)
        if last is not None and self.stopped_early:
            self.watch.doing = "its final checkpoint"
            self.watch.result(self._on_learner(stages.save_checkpoint, self.cfg, [w for w, _ in self.unpassed]))
        self.params.clear()
        self.made.clear()
        self.unpassed = []
        return rows

    def _evaluate_now(self, i: int) -> dict:
        """Scores the learner's params as they stand (everything submitted has finished)."""
        self.watch.doing = "the final evaluation"
        out = self.watch.result(self._evaluate(self._on_learner(stages.policy_params, self.cfg), max(i, 0)))
        self.busy["evaluator"] += out.pop("evaluate_s", 0.0)
        return out

    def _trained(self, it: _Iteration, metrics: dict):
        now = time.perf_counter()
        it.trained_at, it.result = now, metrics
        self.trained += 1
        max_wall = self.config.max_wall_s
        if max_wall and now - self.run_began >= max_wall:
            self.stopped_early = True  # no more iterations; those submitted finish

    @staticmethod
    def _ready(it: _Iteration) -> bool:
        """Trained, its regions committed, and evaluated where due."""
        return (it.result is not None and len(it.written) == len(it.writes)
                and (it.evaluation is None or it.evaluated is not None))

    # -------------------------------------------------------------------- metrics

    def _row(self, it: _Iteration) -> dict:
        config, m = self.config, it.result
        learned = m["learner"]
        interval = max(it.trained_at - self.last_trained, 1e-9)
        self.last_trained = it.trained_at
        collected = m["collected"]
        parts = {"rollout_s": sum(c["rollout_s"] for c in collected),
                 # starting the copy (rollout) and waiting for it (write)
                 "host_copy_s": sum(c["host_copy_s"] for c in collected) + sum(w["host_wait_s"] for w in it.written),
                 "write_s": sum(w["write_s"] for w in it.written)}
        collect_s = sum(parts.values())
        self.busy["learner"] += m["train_s"]
        self.busy["collectors"] += collect_s
        self.lags.update(m["lags"])
        for part, seconds in parts.items():
            self.breakdown[part] += seconds
        for part in ("read_s", "update_s", "publish_s", "checkpoint_s"):
            self.breakdown[part] += m[part]
        n_collector_workers = len(set(self.where.collectors))
        row = {"iteration": it.index + 1, "env_steps": (it.index + 1) * config.steps_per_iteration,
               "return": _mean(c["return_mean"] for c in collected),
               "win_rate": _mean(c["win_rate"] for c in collected),
               "loss": learned.get("loss", float("nan")), **{f"{t}_loss": learned[f"{t}_loss"] for t in m["teams"]},
               "total_updates": m["total_updates"],
               "steps_per_s": config.steps_per_iteration / interval,
               "updates_per_s": m["updates"] / interval,
               "learner_busy": min(1.0, m["train_s"] / interval),
               "collector_busy": min(1.0, collect_s / (n_collector_workers * interval)),
               "policy_lag": _mean(m["lags"]), "policy_lag_max": max(m["lags"])}
        # the rest of what the learner reported (a PPO's entropy, KL and explained variance, a
        # Q-learner's TD error and grad norm), grouped under train/ in TensorBoard and the rest
        row.update({f"train/{k}": v for k, v in learned.items() if k not in row})
        if it.evaluated is not None:
            self._attach(row, it.evaluated)
            self.final_eval = it.evaluated
        return row

    def _attach(self, row: dict, evaluation: dict):
        # the run's own scores, then (a team run) each team's: test_<team>_win_rate, ...
        for prefix in ("", *(f"{team}_" for team in evaluation.get("teams", ()))):
            row.update({f"test_{prefix}win_rate": evaluation[f"{prefix}win_rate"],
                        f"test_{prefix}return": evaluation[f"{prefix}return_mean"]})
            if self.config.n_seeds > 1:  # the spread across seeds, and each seed's own
                row.update({f"test_{prefix}win_rate_std": evaluation[f"{prefix}win_rate_std"],
                            f"test_{prefix}return_std": evaluation[f"{prefix}return_mean_std"],
                            f"test_{prefix}win_rate_per_seed": evaluation[f"{prefix}win_rate_per_seed"],
                            f"test_{prefix}return_per_seed": evaluation[f"{prefix}return_mean_per_seed"]})

    def summary(self) -> dict:
        """Run-wide figures: busy fractions of the wall, the lag histogram, where time went."""
        wall = max(time.perf_counter() - self.began, 1e-9)
        n_collector_workers = len(set(self.where.collectors))
        return {"wall_s": wall,
                "learner_busy": self.busy["learner"] / wall,
                "collector_busy": self.busy["collectors"] / (n_collector_workers * wall),
                "evaluate_s": self.busy["evaluator"],
                "policy_lag_histogram": {int(k): int(v) for k, v in sorted(self.lags.items())},
                "breakdown_s": {k: float(v) for k, v in self.breakdown.items()}}


MAX_LEARNER_MOVES = 3  # a learner that keeps losing its worker stops the run instead
DRAIN_S = 300.0  # how long a move waits for the old dataflow's region writes to finish


def run_moving(client: Client, config: RunConfig, prepare: Callable[[str], dict],
               on_start: Callable[[dict, Placement], None] = lambda start, where: None,
               on_row: Callable[[dict], None] = lambda row: None) -> tuple[list[dict], Dataflow]:
    """Runs the dataflow to its end and returns (rows, the last Dataflow). When the
    learner's worker is lost (LearnerLost: killed or crashed, other workers left), the learner
    moves, at most MAX_LEARNER_MOVES times: the region writes still running finish, the
    placement is made again on the workers alive, and the run resumes from its last
    checkpoint on the new learner's worker (whose mirror reloads the committed regions).

    `prepare(worker)` says where to start on that worker (stages.prepare_run's answer);
    `on_start(start, placement)` hears every start, so a caller that keeps rows per iteration
    drops those after start["iteration"] (a move trains them again)."""
    rows: list[dict] = []

    def row(r):
        rows.append(r)
        on_row(r)

    began = time.perf_counter()
    for moves in range(MAX_LEARNER_MOVES + 1):
        where = Placement.on(client, config)
        start = prepare(where.learner)
        config = RunConfig(**start["config"])  # its ring as fitted to that worker's memory
        rows = [r for r in rows if r["iteration"] <= start["iteration"]]
        on_start(start, where)
        dataflow = Dataflow(client, config, start, where, run_began=began)
        try:
            dataflow.run(row)
            return rows, dataflow
        except LearnerLost as lost:
            if moves == MAX_LEARNER_MOVES:
                raise RunStopped(f"{lost} (the learner already moved {moves} times in this run)") from None
            _drain(client, config.run_dir)
    raise AssertionError("unreachable")


def _drain(client: Client, run_dir: str):
    """Waits until no worker runs a collect call of this run (the dropped dataflow's
    seceded region writes), so the next dataflow never writes a region beside them."""
    deadline = time.monotonic() + DRAIN_S
    while True:
        try:
            running = client.run(stages.collects_running, run_dir, on_error="ignore")
        except Exception as e:  # the comm's own errors, whatever the transport
            raise _unreachable(e, run_dir) from None
        if not any(isinstance(n, int) and n for n in running.values()):
            return
        if time.monotonic() > deadline:
            raise RunStopped(f"region writes of {run_dir} still running after {DRAIN_S:.0f} s on "
                             f"{', '.join(w for w, n in running.items() if n)}; {_resume(run_dir)}")
        time.sleep(0.2)


def _alias(value):
    """`value` under a new key (the first version's params: collectors fetch this key, and
    only the learner's worker holds the one it is taken from)."""
    return value


def _collect_priority(i: int) -> int:
    """Dask priority of iteration i's rollouts and writes: earlier iterations first, with
    room between two iterations for an evaluation (higher runs first; the learner's tasks
    keep Dask's default 0, above every iteration's)."""
    return -2 * i


def _mean(values) -> float:
    values = [v for v in values if v == v]  # drop NaN (a region with no finished episode)
    return sum(values) / len(values) if values else float("nan")
