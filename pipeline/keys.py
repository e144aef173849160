"""The Redis key layout of one pipeline (docs/architecture.md "Redis keys"), owned by this module alone.

Every key shares the prefix `{ns}:` so several pipelines can share one Redis.
arq's queue is `{ns}:queue`; arq's per-job keys (`arq:job:<id>`, `arq:in-progress:<id>`,
`arq:result:<id>`, `arq:retry:<id>`) are global, so the arq job id itself carries the
namespace (`Keys.arq_job_id`).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_NAMESPACE = "rollout"
TRAINER_GROUP = "trainer"  # the stream's consumer group


class Counter:
    """Field names of the `{ns}:counters` hash. All updates are atomic HINCRBY, each inside a
    transaction or script keyed by an operation id, so a retried write never counts twice."""

    ENQUEUED = "enqueued"  # jobs admitted by producers (monotonic; requeues count again)
    RUNNING = "running"  # gauge: groups being generated now
    BUFFERED = "buffered"  # groups pushed into the stream
    DUPLICATES = "duplicates"  # pushes refused by the dedup marker
    ACCEPTED = "accepted"  # groups handed to a training step
    DISCARDED = "discarded"  # groups that left without training (sum of the reasons below)
    STALE = "stale"  # rejected at consumption: staleness above eta
    FILTERED = "filtered"  # dropped by the zero-variance filter
    FAILED = "failed"  # jobs that ended without a group (out of tries)
    REQUEUED = "requeued"  # tasks handed back to the producer
    DEAD = "dead"  # entries written to the dead-letter stream
    EPISODES = "episodes"  # episodes finished (all statuses)
    EPISODES_FAILED = "episodes_failed"
    TOKENS = "tokens"  # response tokens generated


def attempts_field(group_id: str) -> str:
    """A group's field in `{ns}:requeue:attempts`: `{task}:{epoch}`, its id without the attempt
    (`pipeline.schema.job_id_for`: `{task}:{epoch}` or `{task}:{epoch}r{k}`)."""
    task, _, epoch = group_id.rpartition(":")
    return f"{task}:{epoch.partition('r')[0]}"


@dataclass(frozen=True)
class Keys:
    ns: str = DEFAULT_NAMESPACE

    def __post_init__(self) -> None:
        if not self.ns or any(c in self.ns for c in " {}*?[]"):
            raise ValueError(f"namespace {self.ns!r} is empty or has characters unsafe in Redis key patterns")

    def _k(self, suffix: str) -> str:
        return f"{self.ns}:{suffix}"

    @property
    def queue(self) -> str:
        return self._k("queue")

    @property
    def groups(self) -> str:
        return self._k("groups")

    @property
    def dead(self) -> str:
        return self._k("dead")

    @property
    def version(self) -> str:
        return self._k("version")

    @property
    def version_events(self) -> str:
        """Pub/sub channel (no stored key): the version, published with every `version` write, so
        producers wake the moment the bound lets them admit instead of at their next poll."""
        return self._k("version_events")

    @property
    def queued_events(self) -> str:
        """Pub/sub channel (no stored key): the number of jobs an admission just queued, so a
        worker with a free slot takes them at once instead of at its next (backed-off) poll."""
        return self._k("queued_events")

    @property
    def engine(self) -> str:
        return self._k("engine")

    @property
    def policy(self) -> str:
        """Hash {run, version}: the policy version the engines hold, stamped on every generate call."""
        return self._k("policy")

    @property
    def runs(self) -> str:
        """Hash run -> first rollout id of that trainer process (the branch points after resumes)."""
        return self._k("runs")

    @property
    def trainer(self) -> str:
        return self._k("trainer")

    @property
    def counters(self) -> str:
        return self._k("counters")

    @property
    def workers(self) -> str:
        return self._k("workers")

    @property
    def cursor(self) -> str:
        return self._k("cursor")

    @property
    def requeue(self) -> str:
        """List of msgpack Tasks the trainer side handed back (stale/failed) for re-admission."""
        return self._k("requeue")

    @property
    def open(self) -> str:
        """Sorted set group id -> admission clock (the `{ns}:version` its admission counted
        against): every admitted group not yet taken by a training step or discarded. Written
        by the admission scripts, trimmed where a group leaves (a step records it, a discard,
        a dead letter); the trainer's due-first order reads it (docs/architecture.md)."""
        return self._k("open")

    def eval_stream(self, round_id: str) -> str:
        """Stream of one evaluation round's scored groups (pipeline/eval/evaluation.py): workers push
        eval groups here, never into `{ns}:groups`; the trainer deletes it after the round."""
        return self._k(f"eval:{round_id}")

    @property
    def eval_rounds(self) -> str:
        """Hash round id -> `RoundRecord` (JSON) of every background evaluation round in flight
        (pipeline/eval/background.py): what a restarted trainer collects; removed when reported."""
        return self._k("eval_rounds")

    @property
    def eval_done(self) -> str:
        """Hash round id -> the reported round's summary (JSON): state, versions, counts."""
        return self._k("eval_done")

    @property
    def eval_calls(self) -> str:
        """Hash of background evaluation by slime's eval call (pipeline/eval/background.py):
        `<rollout id>` -> the round that call started, `<rollout id>:logged` -> the round whose
        report was handed to the logger. A trainer that resumes and calls eval for the same rollout
        id again starts no second round, and a crash between the log and the retire logs it once."""
        return self._k("eval_calls")

    @property
    def eval_results(self) -> str:
        """Hash dataset -> `DatasetResult` (JSON) of the last evaluation round reported (either
        mode, pipeline/eval/evaluation.py): what the monitor shows."""
        return self._k("eval_results")

    @property
    def eval_stats(self) -> str:
        """Hash of background evaluation counts: started, skipped, reported, failed, and `seq`
        (eval jobs enqueued so far: the next round's queue scores follow the last one's)."""
        return self._k("eval_stats")

    @property
    def requeue_attempts(self) -> str:
        """Hash `{task}:{epoch}` -> the highest attempt admitted for that (task, epoch). A field
        is deleted where its task ends: trained (the step's record), or dead-lettered for good
        (a worker's last hand-back, the producer past max_requeues)."""
        return self._k("requeue:attempts")

    @property
    def recent(self) -> str:
        """Capped list of small per-group summaries (env, reward mean, staleness) for the monitor."""
        return self._k("recent")

    @property
    def trained(self) -> str:
        """Capped list, newest first, of the trainer's steps: the staleness of each group at the step
        that trained it (pipeline/slime/trained_log.py), for the monitor's staleness of what was trained."""
        return self._k("trained")

    def arq_job_id(self, group_id: str) -> str:
        """arq's job id for the group `group_id` (= `PromptJob.job_id`): `{ns}:{group_id}`.

        arq keys a job by its id alone (`arq:job:<id>`, `arq:in-progress:<id>`, ...), not by
        queue: without the namespace, two pipelines on one Redis with the same task ids would
        refuse or hold each other's jobs. The group id stays the dedup key inside the namespace.
        """
        return self._k(group_id)

    def group_id_of(self, arq_job_id: str) -> str:
        """The group id inside one of this namespace's arq job ids (inverse of `arq_job_id`)."""
        prefix = self._k("")
        if not arq_job_id.startswith(prefix):
            raise ValueError(f"arq job id {arq_job_id!r} is not in namespace {self.ns!r}")
        return arq_job_id[len(prefix):]

    def worker_jobs(self, worker_id: str) -> str:
        """Set of arq job ids a worker is running: the reaper releases them when it dies."""
        return self._k(f"worker:{worker_id}:jobs")

    @property
    def job_owners(self) -> str:
        """Hash arq job id -> the worker whose job set holds it (written with the set, in one
        script): the orphan sweep asks it per job instead of walking every worker's set."""
        return self._k("job_owners")

    @property
    def owner_recorders(self) -> str:
        """Set of worker ids that record their jobs in `job_owners` (added by a worker's first
        beat, removed when it leaves or is reaped). A live worker not in it runs the version
        before the owners hash (a rolling upgrade): the orphan sweep reads its job set instead."""
        return self._k("liveness:recorders")

    @property
    def liveness_lease(self) -> str:
        """String, expires after one heartbeat: the worker holding it runs this interval's sweep
        (reaper and orphan check) for the whole cluster."""
        return self._k("liveness:lease")

    @property
    def orphan_suspects(self) -> str:
        """Hash arq job id -> Redis time it was first seen in progress with no owner (bounded by
        `workers.liveness.ORPHAN_SCAN` per sweep; cleared when confirmed or owned)."""
        return self._k("liveness:suspects")

    @property
    def orphan_cursor(self) -> str:
        """String: the ZSCAN cursor of `{ns}:queue` where the next orphan sweep goes on (0 after
        a full pass)."""
        return self._k("liveness:cursor")

    @property
    def sweep_cursors(self) -> str:
        """Hash: where the next sweep's looks for entries of workers that are gone go on, `owners`
        (HSCAN cursor of `job_owners`) and `recorders` (SSCAN cursor of `owner_recorders`)."""
        return self._k("liveness:cursors")

    @property
    def job_errors(self) -> str:
        """Hash job id -> last error of a job that will be retried (for its dead letter)."""
        return self._k("job_errors")

    def dedup(self, group_id: str) -> str:
        return self._k(f"dedup:{group_id}")

    def op(self, op_id: str) -> str:
        """String, short TTL: the writes of operation `op_id` were applied (`redis_conn.run_once`,
        idempotent scripts): a retry after a lost reply finds it and applies nothing twice."""
        return self._k(f"op:{op_id}")

    def consumed(self, rollout_id: int) -> str:
        return self._k(f"consumed:{rollout_id}")

    @property
    def recorded_steps(self) -> str:
        """Sorted set: the rollout ids that have a `consumed:{rid}` record not yet acknowledged
        (score = rid). Written in the transaction that records a step, trimmed by `save`: the
        data source finds its recorded steps here, never by scanning the keyspace."""
        return self._k("steps")

    @property
    def consumed_pattern(self) -> str:
        return self._k("consumed:*")

    def rollout_id_of(self, consumed_key: str) -> int:
        return int(consumed_key.rsplit(":", 1)[1])
