"""The one base of every Kubernetes job kind (KubeRay's RayJob, Kubeflow Trainer's TrainJob).

A job is one object named after the job id, labelled as ours. `KubeJobBackend` owns what does
not depend on the kind; a subclass adds its manifests, status mapping, stop and log source.

Waiting is served by informers (`kube.Informer`): the job kind, plus the pods of the jobs when
the kind reads them, plus Kueue's Workloads of the namespace once a job of ours may queue there
(`_kueue.py`: a suspended job Kueue holds reads QUEUED with its Workload's reason, never
STOPPED). They follow these rules:

- created when a watcher subscribes, one set per backend instance; stopped on the last
  unsubscribe and by `close()`. An instance nobody subscribed to starts no thread: `statuses()`
  answers from one list request for all ids.
- an informer whose thread died for any reason other than our own stop is replaced (on the
  next `statuses()`; on `subscribe()` also one that credentials since fixed may revive).
- a watch rejected with 401/403 raises `AuthenticationFailed` at once; any other trouble is
  `BackendUnavailable`, which the watcher retries within the block's unreachable budget.
- informers wake the subscribers on changes and on errors too, so a failure is seen at once.
- after `close()`, `statuses()` raises `BackendClosed`.

A FAILED job says why (`JobStatus.failure`, `_kube_objects.pod_failure`): its pods (the kind's
`failure_pods`: the watched ones with the failed pods the informer saw go, or one listing) and
the Nodes they ran on are read once per job object, never per poll; where they say nothing, the
kind's `object_failure` (its reason alone), else None and the lifecycle reads the log tail.

What every kind writes and reads the same way without the API (the job object's metadata, the
Secret of secret env values, label checks, timestamps, the memory of deleted jobs and last
logs) is in `_kube_objects.py`. No Prefect import.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from prefect_nemo.backends._kube_objects import (
    OWNED_ANNOTATION,
    JobMemory,
    parse_time,
    pod_failure,
    pod_nodes,
)
from prefect_nemo.backends._kueue import (
    JOB_UID_LABEL,
    LOCAL_QUEUE,
    QUEUE_LABEL,
    VISIBILITY,
    WORKLOAD,
    KueueTarget,
    Positions,
    kueue_holds,
    kueue_target,
    queued_status,
    workload_owner,
)
from prefect_nemo.errors import (
    AuthenticationFailed,
    BackendClosed,
    BackendUnavailable,
    InvalidJobSpec,
    JobAlreadyExists,
)
from prefect_nemo.jobs import Failure, JobHandle, JobSpec, JobState, JobStatus, OwnedJob
from prefect_nemo.kube import (
    CONFIGMAP,
    FLOW_RUN_LABEL,
    MANAGED_BY,
    NODE,
    POD,
    SECRET,
    Access,
    AlreadyExists,
    Forbidden,
    Informer,
    Invalid,
    Kind,
    KubeApi,
    KubeError,
    NotFound,
    add_owner_reference,
    wait_for,
)
from prefect_nemo.names import check_namespace

MANAGED = f"{MANAGED_BY}=prefect-nemo"


class QueueConfig(Protocol):
    """What every job kind's config says about Kueue: its block's LocalQueue and priority."""

    @property
    def queue_name(self) -> str | None: ...

    @property
    def priority_class(self) -> str | None: ...


ConfigT = TypeVar("ConfigT", bound=QueueConfig)
INFORMER_STOP_WAIT_S = 5.0  # how long stopping waits for each informer thread to end
WORKLOAD_RETRY_S = 60.0  # a dead Workload informer (Kueue not served?) is retried this seldom
CHANGE_LOG = 8192  # job changes kept for changed_since(); an older version gets "ask all"


# -------------------------------------------------------------------------------------------
# The base


class KubeJobBackend(Generic[ConfigT]):
    """What every Kubernetes job backend shares: identity, access check, find, the informers
    behind statuses() (see the module docstring), close, the stop-by-delete and the log memory.

    A subclass sets the class attributes and implements `job_status` and `read_log` (plus the
    Backend methods of its own: validate, submit, request_stop, tail_logs); `config` is its
    block's settings.
    """

    kind: ClassVar[str]
    max_job_id_len: ClassVar[int]
    job_kind: ClassVar[Kind]  # the job's object (RayJob, TrainJob)
    crd_fix: ClassVar[str]  # what to install when the API server does not serve job_kind
    deleted_message: ClassVar[str]  # the STOPPED message of a job we deleted to stop it
    block: ClassVar[str]  # the block's class name, for messages naming its fields
    pod_job_label: ClassVar[str | None] = None  # a label naming the job on its pods: watch them
    # how delete_to_stop deletes: Foreground, so the object is gone only after its dependents
    stop_propagation: ClassVar[str] = "Foreground"
    log_errors: ClassVar[tuple[type[Exception], ...]] = (BackendUnavailable, NotFound)
    memory: ClassVar[JobMemory]  # one per subclass, shared by its instances

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.memory = JobMemory()

    def __init__(self, api: KubeApi, config: ConfigT, *, namespace: str | None = None) -> None:
        self.api = api
        self.config = config
        self.namespace = check_namespace(namespace or api.namespace)
        self._lock = threading.Lock()
        self._informers: tuple[Informer, ...] = ()  # (jobs, pods?) while subscribed
        self._wakes: list[Callable[[], None]] = []
        self._closed = False
        # statuses() memo: job id -> (resourceVersions of its object and pods, its status)
        self._parsed: dict[str, tuple[tuple[str, ...], JobStatus]] = {}
        # what changed, for changed_since(): (version, job id), newest last
        self._version = 0
        self._changes: deque[tuple[int, str]] = deque(maxlen=CHANGE_LOG)
        self._all_since = 0  # the version after which any job may have changed (ask all)
        # Kueue: watch Workloads once a job of ours may queue (a queue on the block, a submit
        # with JobSpec.queue, a queue-labelled job seen); positions asked per LocalQueue
        self._kueue = config.queue_name is not None
        self._positions = Positions(api, self.namespace)
        # why a FAILED job failed, found once per job object (uid): job id -> (uid, failure)
        self._failures: dict[str, tuple[str, Failure | None]] = {}
        # the failed or disrupted pods the pod informer saw, by job id and pod uid: the pod GC
        # deletes a lost node's pods, often before the job's own status says FAILED
        self._failed_pods: dict[str, dict[str, dict[str, Any]]] = {}
        self._nodes_readable = True  # False once RBAC refused a Node read: not asked again

    # -- to implement ---------------------------------------------------------------------------

    def job_status(self, obj: dict[str, Any], pods: list[dict[str, Any]]) -> JobStatus:
        """Our JobStatus from the job's object (and its pods, when pod_job_label is set)."""
        raise NotImplementedError

    def read_log(self, job_id: str) -> str | None:
        """The job's whole log from its source; None while (or once) there is none to read."""
        raise NotImplementedError

    def failure_pods(self, obj: dict[str, Any], pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The pods that tell why a FAILED job failed, read once when it is seen FAILED: by
        default its pods (pod_job_label) with the failed ones the informer saw go."""
        name = (obj.get("metadata") or {}).get("name", "")
        current = {p["metadata"].get("uid"): p for p in pods}
        gone = [
            p for uid, p in self._failed_pods.get(name, {}).copy().items() if uid not in current
        ]
        return [*pods, *gone]

    def object_failure(self, obj: dict[str, Any]) -> Failure | None:
        """What the job's object alone says of its failure when its pods say nothing."""
        return None

    def stop_left_running(self, obj: dict[str, Any]) -> None:
        """Stop what a FAILED job object left running that its operator will not stop; asked
        once per failed object, before its failure is classified. Nothing for most kinds."""

    def access(self) -> tuple[Access, ...]:
        """The verbs this backend uses on each resource, for RBAC (the one list: the README's
        permissions and `prefect-nemo doctor` read it)."""
        raise NotImplementedError

    def kueue_access(self) -> tuple[Access, ...]:
        """With a Kueue queue on the block: read the Workloads (why a job waits, its
        preemptions) and the LocalQueue, and the visibility API's positions (optional)."""
        if self.config.queue_name is None:
            return ()
        return (
            Access(WORKLOAD, ("get", "list", "watch")),
            Access(LOCAL_QUEUE, ("get",)),
            Access(VISIBILITY, ("get",), subresource="pendingworkloads",
                   optional="a queued job's position in its LocalQueue"),
        )  # fmt: skip

    def kueue_target(self, spec: JobSpec) -> KueueTarget | None:
        """The LocalQueue (and priority) of a job: JobSpec.queue/priority over the block's;
        InvalidJobSpec for a value Kueue's labels cannot carry."""
        return kueue_target(spec, self.config.queue_name, self.config.priority_class, self.block)

    # -- identity ------------------------------------------------------------------------------

    @property
    def cluster(self) -> str:
        """API server, namespace and kind: one watcher (and one set of informers) each."""
        return f"{self.api.host}/namespaces/{self.namespace}/{self.job_kind.plural}"

    @property
    def credentials_key(self) -> str:
        """The API credentials, hashed."""
        return self.api.credentials_key

    @property
    def secrets(self) -> list[str]:
        """The API credentials, for redaction."""
        return list(self.api.secrets)

    def object_url(self, job_id: str) -> str:
        """The job object's path on the API server."""
        kind = self.job_kind
        return (
            f"{self.api.host}/apis/{kind.group}/{kind.version}/namespaces/"
            f"{self.namespace}/{kind.plural}/{job_id}"
        )

    def links(self, job_id: str) -> dict[str, str]:
        """The handle's links: the job object ("rayjob", "trainjob")."""
        return {self.job_kind.kind.lower(): self.object_url(job_id)}

    def handle(self, job_id: str) -> JobHandle:
        """The handle with the job object's API path."""
        return JobHandle(
            backend=self.kind, cluster=self.cluster, job_id=job_id, links=self.links(job_id)
        )

    # -- Backend protocol -----------------------------------------------------------------------

    def check_access(self) -> None:
        """Reach the API server and prove we may list the job kind (its operator installed)."""
        kind = self.job_kind
        try:
            self.api.list(kind, self.namespace, label_selector=MANAGED, limit=1)
        except NotFound:
            raise BackendUnavailable(
                f"the API server at {self.api.host} does not serve {kind.plural}.{kind.group}/"
                f"{kind.version}: {self.crd_fix}"
            ) from None

    def find(self, job_id: str) -> JobStatus | None:
        """The job's status (a GET, and a pod list when the kind reads pods), STOPPED if we
        deleted it, None if there is no such job; BackendClosed after close()."""
        self._check_open()
        obj = self.api.get(self.job_kind, job_id, self.namespace)
        if obj is None:
            return self._deleted_status(job_id)
        pods: list[dict[str, Any]] = []
        if self.pod_job_label:
            pods, _ = self.api.list(
                POD, self.namespace, label_selector=f"{self.pod_job_label}={job_id}"
            )
        return self._status(obj, pods, None)

    def statuses(self, job_ids: Collection[str]) -> dict[str, JobStatus]:
        """From the informers' caches while a watcher is subscribed, else from one list; one GET
        only for an id neither has (gone, or not labelled as ours)."""
        cached = self._cached(job_ids) if self._checked_informers() else None
        objects, pods = cached or self._listed()
        workloads = self._cached_workloads()
        out: dict[str, JobStatus] = {}
        parsed = self._parsed
        if len(parsed) > CHANGE_LOG:  # forget jobs nobody asks about any more
            wanted = set(job_ids)
            parsed = self._parsed = {k: v for k, v in parsed.items() if k in wanted}
        for job_id in job_ids:
            obj = objects.get(job_id)
            if obj is None:
                status = self.find(job_id)
            else:  # a thousand watched jobs: map only the objects that changed since last time
                job_pods = pods.get(job_id, [])
                workload = (workloads or {}).get(job_id)
                seen = [obj, *job_pods, *([workload] if workload else [])]
                versions = tuple(o["metadata"].get("resourceVersion", "") for o in seen)
                known = self._parsed.get(job_id)
                status = known[1] if known and known[0] == versions else None
                if status is None:
                    status = self._status(obj, job_pods, workloads)
                parsed[job_id] = (versions, status)
            if status is not None:
                out[job_id] = status
        return out

    def changed_since(self, version: int) -> tuple[int, set[str] | None]:
        """The jobs whose object or pods the informers saw change after `version` (None: any
        may have: an informer (re)started or failed, or the change log forgot that far back),
        with the version now. The watcher then maps only those (a thousand idle jobs cost
        nothing)."""
        with self._lock:
            now = self._version
            if self._all_since > version or (
                len(self._changes) == CHANGE_LOG and self._changes[0][0] > version + 1
            ):
                return now, None
            changed: set[str] = set()
            for at, job_id in reversed(self._changes):
                if at <= version:
                    break
                changed.add(job_id)
            return now, changed

    def owned_jobs(self) -> list[OwnedJob]:
        """Our jobs in the namespace that have not ended, from ONE list by our managed-by
        label: the owner from the job's FLOW_RUN_LABEL, the state from the job's object alone
        (no pod list), submitted_at from its creationTimestamp. An object without our label
        (not submitted by prefect-nemo) is never listed."""
        self._check_open()
        items, _ = self.api.list(self.job_kind, self.namespace, label_selector=MANAGED)
        owned = []
        for obj in items:
            state = self._status(obj, [], None, classify=False).state
            if state.is_terminal():
                continue
            meta = obj.get("metadata") or {}
            owned.append(
                OwnedJob(
                    job_id=meta["name"],
                    state=state,
                    flow_run_id=(meta.get("labels") or {}).get(FLOW_RUN_LABEL) or None,
                    submitted_at=parse_time(meta.get("creationTimestamp")),
                )
            )
        return owned

    def subscribe(self, wake: Callable[[], None]) -> Callable[[], None]:
        """Wake the watcher on every change of our jobs (and their pods) in the namespace, and
        on every watch error; the informers start with the first subscriber."""
        with self._lock:
            self._wakes.append(wake)
            if not self._closed:  # closed: statuses() tells the watcher
                self._ensure_informers(replace_failed=True)

        def unsubscribe() -> None:
            with self._lock:
                if wake in self._wakes:
                    self._wakes.remove(wake)
                if self._wakes:
                    return
                informers, self._informers = self._informers, ()
            for informer in informers:
                informer.stop(wait_s=INFORMER_STOP_WAIT_S)

        return unsubscribe

    def close(self) -> None:
        """Stop the informers (their watches are cut at once, their threads end) and wake the
        subscribed watchers, whose next poll then raises BackendClosed, as does every later
        call that would ask the API server (find, logs). Idempotent."""
        with self._lock:
            self._closed = True
            informers, self._informers = self._informers, ()
        for informer in informers:
            informer.stop(wait_s=INFORMER_STOP_WAIT_S)
        self._wake_all()

    def logs(self, job_id: str) -> str:
        """The job's whole log; the last read once its source is gone (teardown took it)."""
        self._check_open()
        key = (self.cluster, job_id)
        try:
            text = self.read_log(job_id)
        except self.log_errors:
            cached = self.memory.last_log(key)
            if cached is None:
                raise
            return cached
        if text is None:
            return self.memory.last_log(key) or ""
        return self.memory.remember_log(key, text)

    @property
    def informers(self) -> tuple[Informer, ...]:
        """The running informers (the job kind first, then pods); empty while nobody subscribed."""
        with self._lock:
            return self._informers

    # -- for subclasses ------------------------------------------------------------------------

    def current_status(self, job_id: str) -> JobStatus | None:
        """From the informers' cache when they run and have the job (no request), else find()."""
        objects, pods = self._cached([job_id]) or ({}, {})
        if job_id in objects:
            return self._status(objects[job_id], pods.get(job_id, []), self._cached_workloads())
        return self.find(job_id)

    def use_kueue(self) -> None:
        """A job of ours may queue in Kueue: watch Workloads too (from now, if watching)."""
        with self._lock:
            if self._kueue:
                return
            self._kueue = True
            if self._informers and not self._closed:
                self._ensure_informers(replace_failed=False)

    def create_job(
        self,
        manifest: dict[str, Any],
        owned: list[tuple[Kind, dict[str, Any]]],
        *,
        fix: str,
        prepare: Callable[[], None] = lambda: None,
    ) -> dict[str, Any]:
        """Create the job: `prepare()` (what it needs that outlives it), the `owned` objects its
        pods read at start (listed in its OWNED_ANNOTATION), then its object, which then owns
        them, so deleting it deletes them. JobAlreadyExists when the name is taken (attach); an
        existing job adopts its orphans (a submit that died between the two steps).

        A definite no (rejected, or our credentials refused) deletes the `owned` objects again
        (nothing else will own them); a timeout leaves them, since the job may exist. A
        rejection becomes InvalidJobSpec with the server's reason and `fix`.
        """
        job_id = manifest["metadata"]["name"]
        taken = f"{self.job_kind.kind} '{job_id}' already exists"
        # with objects to create first, look before making them again for a job that exists;
        # without, the create itself tells (one request per submit, not two)
        existing = self.api.get(self.job_kind, job_id, self.namespace) if owned else None
        if existing is not None:
            self._adopt(existing)
            raise JobAlreadyExists(taken)
        prepare()
        for kind, obj in owned:
            self._create_fresh(kind, obj)
        self.memory.forget_deleted((self.cluster, job_id))
        try:
            created = self.api.create(self.job_kind, manifest, self.namespace)
        except AlreadyExists:  # a concurrent submitter won: its job owns what we re-made
            if (winner := self.api.get(self.job_kind, job_id, self.namespace)) is not None:
                self._adopt(winner)
            raise JobAlreadyExists(taken) from None
        except (Invalid, AuthenticationFailed) as exc:
            for kind, obj in owned:
                self.api.delete(kind, obj["metadata"]["name"], self.namespace)
            if isinstance(exc, AuthenticationFailed):
                raise
            raise InvalidJobSpec(
                f"the API server rejected {self.job_kind.kind} '{job_id}': {exc}. {fix}"
            ) from None
        self._adopt(created)
        return created

    def delete_to_stop(self, job_id: str) -> None:
        """Delete the job's object (`stop_propagation`), remembering that we did, so the job
        reads STOPPED once it is gone (`_deleted_status`)."""
        self.memory.mark_deleted((self.cluster, job_id))
        self.api.delete(self.job_kind, job_id, self.namespace, propagation=self.stop_propagation)

    # -- informers -------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """close() was called (a watcher whose poll failed meanwhile says nothing more)."""
        return self._closed

    def _check_open(self) -> None:
        """A closed backend asks the API server nothing more: BackendClosed."""
        if self._closed:
            raise BackendClosed(f"the {self.kind} backend of {self.cluster} was closed")

    def _checked_informers(self) -> tuple[Informer, ...]:
        """The running informers (none when nobody subscribed), dead ones replaced; raises
        BackendClosed after close(), AuthenticationFailed at once, BackendUnavailable for a
        watch that is failing (the watcher retries within its budget)."""
        with self._lock:
            self._check_open()
            if not self._informers:
                return ()
            for informer in self._informers:
                if informer.kind is not WORKLOAD:
                    informer.raise_rejected()
            informers = self._ensure_informers(replace_failed=False)
        for informer in informers:
            # the Workloads only add detail: without them (no Kueue, no RBAC) a held job reads
            # QUEUED by its label, and its Workload is asked for (`_workload_of`)
            if informer.error is not None and informer.kind is not WORKLOAD:
                raise BackendUnavailable(
                    f"watch of {informer.kind.plural} in {self.namespace} on {self.api.host} "
                    f"broke: {informer.error}"
                )
        return informers

    def _ensure_informers(self, *, replace_failed: bool) -> tuple[Informer, ...]:
        """Start the informers, replacing any whose thread died (and, with replace_failed, any
        that credentials rejected: they may have been fixed). Call with the lock held."""
        wanted: list[tuple[Kind, str | None, Callable[[str, dict[str, Any]], None]]] = [
            (self.job_kind, MANAGED, self._job_changed)]  # fmt: skip
        if self.pod_job_label:
            wanted.append((POD, f"{MANAGED},{self.pod_job_label}", self._pod_changed))
        if self._kueue:  # Kueue's Workloads carry no label of ours: all of the namespace
            wanted.append((WORKLOAD, None, self._workload_changed))
        current = {informer.kind: informer for informer in self._informers}
        for kind, selector, on_change in wanted:
            old = current.get(kind)
            if old is None or (old.dead and _retry_dead(old, replace_failed)):
                if old is not None:
                    old.stop()
                current[kind] = Informer(
                    self.api, kind, self.namespace, label_selector=selector,
                    on_change=on_change, on_error=self._wake_all,
                ).start()  # fmt: skip
                self._version += 1
                self._all_since = self._version  # a new cache: ask about every job once
        self._informers = tuple(current[kind] for kind, _, _ in wanted)
        return self._informers

    def _informer(self, kind: Kind) -> Informer | None:
        return next((i for i in self.informers if i.kind is kind), None)

    def _cached(
        self, job_ids: Collection[str]
    ) -> tuple[dict[str, dict[str, Any]], dict[str, list[dict[str, Any]]]] | None:
        """These jobs by name (those the cache has) and their pods by job from the informers,
        once they have listed: a lookup per job, so asking about a few costs little."""
        informers = self.informers
        if not informers or not all(i.synced.is_set() for i in informers if i.kind is not WORKLOAD):
            return None
        pod_informer = self._informer(POD)
        pods = pod_informer.items() if pod_informer is not None else []
        found = ((job_id, informers[0].get(job_id)) for job_id in job_ids)
        return {j: o for j, o in found if o is not None}, self._pods_by_job(pods)

    def _cached_workloads(self) -> dict[str, dict[str, Any]] | None:
        """Kueue's Workloads of our jobs by job name from the Workload informer; None without
        one (no watcher: then a held job's Workload is asked for). Empty while it lists or once
        it has died (Kueue not served, no RBAC): a held job reads QUEUED by its queue label
        meanwhile, and the informer's first list wakes every job it finds a Workload for.
        Asking per job instead cost a request per status (101 for 120 queued jobs on a loaded
        machine)."""
        informer = self._informer(WORKLOAD)
        if informer is None:
            return None
        if informer.dead or not informer.synced.is_set():
            return {}
        by_job: dict[str, dict[str, Any]] = {}
        for workload in informer.items():
            if (owner := workload_owner(workload, self.job_kind)) is not None:
                by_job[owner] = workload
        return by_job

    def _status(
        self,
        obj: dict[str, Any],
        pods: list[dict[str, Any]],
        workloads: dict[str, dict[str, Any]] | None,
        *,
        classify: bool = True,
    ) -> JobStatus:
        """The kind's status, QUEUED while Kueue holds the job (suspended for quota or after
        a preemption: never STOPPED), with its Workload's reason and its queue position; a
        FAILED one with why (`_failure`), unless `classify` is off (a listing's states)."""
        status = self.job_status(obj, pods)
        if classify and status.state is JobState.FAILED and status.failure is None:
            if (failure := self._failure(obj, pods)) is not None:
                status = status.model_copy(update={"failure": failure})
        meta = obj.get("metadata") or {}
        if (obj.get("spec") or {}).get("suspend") is not True or meta.get("deletionTimestamp"):
            return status
        labelled = QUEUE_LABEL in (meta.get("labels") or {})
        if labelled and not self._kueue:
            self.use_kueue()
        if workloads is not None:
            workload = workloads.get(meta.get("name", ""))
            uid = ((workload or {}).get("metadata", {}).get("labels") or {}).get(JOB_UID_LABEL)
            if uid not in (None, meta.get("uid")):  # a Workload of an earlier job of this name
                workload = None
        elif labelled or self._kueue:
            workload = self._workload_of(meta.get("uid"))
        else:
            workload = None
        if not kueue_holds(obj, workload):
            return status
        queue = (meta.get("labels") or {}).get(QUEUE_LABEL) or (
            (workload or {}).get("spec") or {}).get("queueName")  # fmt: skip
        name = (workload or {}).get("metadata", {}).get("name")
        position, pending = self._positions.of(queue, name) if queue else (None, None)
        return queued_status(status, obj, workload, position, pending)

    def _failure(self, obj: dict[str, Any], pods: list[dict[str, Any]]) -> Failure | None:
        """Why the FAILED job failed, from its pods and their Nodes (`pod_failure`), else its
        object (`object_failure`); asked once per job object, so a watched failure costs its
        reads (the kind's pods, the Nodes they ran on) once, not once per poll."""
        meta = obj.get("metadata") or {}
        name, uid = meta.get("name", ""), meta.get("uid") or ""
        known = self._failures.get(name)
        if known is not None and known[0] == uid:
            return known[1]
        self.stop_left_running(obj)
        try:
            evidence = self.failure_pods(obj, pods)
        except (KubeError, AuthenticationFailed):  # no RBAC for them: the object tells
            evidence = pods
        failure = pod_failure(evidence, self._nodes(pod_nodes(evidence))) or self.object_failure(
            obj
        )
        if len(self._failures) >= CHANGE_LOG:
            self._failures.pop(next(iter(self._failures)))
        self._failures[name] = (uid, failure)
        return failure

    def _nodes(self, names: Collection[str]) -> dict[str, dict[str, Any] | None]:
        """The Nodes by name (None: gone); none at all once RBAC refused one (Nodes are
        cluster-scoped: a namespaced Role cannot read them, and pods tell most anyway)."""
        nodes: dict[str, dict[str, Any] | None] = {}
        for name in sorted(names):
            if not self._nodes_readable:
                break
            try:
                nodes[name] = self.api.get(NODE, name)
            except (Forbidden, KubeError):
                self._nodes_readable = False
        return nodes

    def _workload_of(self, uid: str | None) -> dict[str, Any] | None:
        """The job's Workload by Kueue's job-uid label (one list), None when there is none or
        Kueue is not installed."""
        if not uid:
            return None
        try:
            items, _ = self.api.list(WORKLOAD, self.namespace,
                                     label_selector=f"{JOB_UID_LABEL}={uid}")  # fmt: skip
        except (KubeError, Forbidden):  # no Kueue, or no RBAC: the queue label tells
            return None
        return items[0] if items else None

    def _listed(self) -> tuple[dict[str, dict[str, Any]], dict[str, list[dict[str, Any]]]]:
        """Our jobs by name (and their pods by job) from one list request each: no thread."""
        items, _ = self.api.list(self.job_kind, self.namespace, label_selector=MANAGED)
        pods: list[dict[str, Any]] = []
        if self.pod_job_label:
            pods, _ = self.api.list(
                POD, self.namespace, label_selector=f"{MANAGED},{self.pod_job_label}"
            )
        return {o["metadata"]["name"]: o for o in items}, self._pods_by_job(pods)

    def _pods_by_job(self, pods: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
        by_job: dict[str, list[dict[str, Any]]] = {}
        for pod in pods:
            job_id = (pod["metadata"].get("labels") or {}).get(self.pod_job_label or "")
            if job_id:
                by_job.setdefault(job_id, []).append(pod)
        return by_job

    def _create_fresh(self, kind: Kind, obj: dict[str, Any]) -> None:
        """Create an object the job will own. One left by a submit that died before the job
        existed is reused if it is a code ConfigMap (immutable, named by its content) and
        replaced if it is the Secret (its values may have changed); one still owned by an
        earlier job of this name (being garbage-collected) is waited out and recreated."""
        name = obj["metadata"]["name"]
        try:
            self.api.create(kind, obj, self.namespace)
            return
        except AlreadyExists:
            existing = self.api.get(kind, name, self.namespace) or {}
        meta = existing.get("metadata") or {}
        leftover = not meta.get("ownerReferences") and not meta.get("deletionTimestamp")
        if kind is CONFIGMAP and leftover:
            return
        self.api.delete(kind, name, self.namespace)
        wait_for(
            self.api, kind, name, lambda o: o is None, namespace=self.namespace,
            timeout_s=60, what=f"deletion of the leftover {kind.kind} {name}",
        )  # fmt: skip
        self.api.create(kind, obj, self.namespace)

    def _adopt(self, job: dict[str, Any]) -> None:
        """Make the job's object an owner of the objects its OWNED_ANNOTATION names
        (idempotent), so deleting it deletes them."""
        annotations = (job.get("metadata") or {}).get("annotations") or {}
        try:
            owned = json.loads(annotations.get(OWNED_ANNOTATION) or "{}")
        except ValueError:
            return
        kinds = {"secrets": SECRET, "configmaps": CONFIGMAP}
        for plural, names in owned.items():
            for name in names:
                try:
                    add_owner_reference(self.api, kinds[plural], name, job, self.namespace)
                except (NotFound, KeyError):
                    continue

    def _job_changed(self, _event: str, obj: dict[str, Any]) -> None:
        self._changed(obj["metadata"]["name"])

    def _workload_changed(self, _event: str, workload: dict[str, Any]) -> None:
        if (job_id := workload_owner(workload, self.job_kind)) is not None:
            self._changed(job_id)

    def _pod_changed(self, _event: str, pod: dict[str, Any]) -> None:
        job_id = (pod["metadata"].get("labels") or {}).get(self.pod_job_label or "")
        if job_id:
            status = pod.get("status") or {}
            disrupted = any(
                c.get("type") == "DisruptionTarget" for c in status.get("conditions") or []
            )
            if disrupted or status.get("phase") == "Failed":  # kept for _failure after it goes
                if job_id not in self._failed_pods and len(self._failed_pods) >= CHANGE_LOG:
                    self._failed_pods.pop(next(iter(self._failed_pods)))
                self._failed_pods.setdefault(job_id, {})[pod["metadata"].get("uid", "")] = pod
            self._changed(job_id)

    def _changed(self, job_id: str) -> None:
        """Log the job's change for changed_since() and wake the subscribers."""
        with self._lock:
            self._version += 1
            self._changes.append((self._version, job_id))
            wakes = list(self._wakes)
        for wake in wakes:
            wake()

    def _wake_all(self, *_error: object) -> None:
        """Any job may have changed (a watch error, close): wake the subscribers to ask all."""
        with self._lock:
            self._version += 1
            self._all_since = self._version
            wakes = list(self._wakes)
        for wake in wakes:
            wake()

    def _deleted_status(self, job_id: str) -> JobStatus | None:
        """STOPPED for a job we deleted and that is gone, None for one we never deleted."""
        if not self.memory.was_deleted((self.cluster, job_id)):
            return None
        return JobStatus(job_id=job_id, state=JobState.STOPPED, message=self.deleted_message)


def _retry_dead(informer: Informer, on_subscribe: bool) -> bool:
    """Whether a dead informer is replaced now: one that credentials rejected only on a new
    subscriber (they may have been fixed); a dead Workload informer (Kueue not served, no RBAC)
    only on a new subscriber and once a while, as every job subscribes and each retry is a list
    (110 lists for 120 jobs on a loaded machine, when each subscriber retried)."""
    if informer.kind is WORKLOAD:
        died = informer.died_at or time.monotonic()
        return on_subscribe and time.monotonic() - died >= WORKLOAD_RETRY_S
    return on_subscribe or not isinstance(informer.error, AuthenticationFailed)
