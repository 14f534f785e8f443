"""Watching a healthy replica set (`placement.replicas`): a replica whose process dies is
restarted up to `ReplicaOptions.max_restarts`, then the set fails instead of serving smaller.
No Prefect here: `tasks/replicas.py` reports what the watch sees."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import RayActorError

from prefect_nemo.placement import NAMESPACE, ReplicaFailed
from prefect_nemo.placement.replicas import Replica, ReplicaOptions, ReplicaSet, wait_healthy

log = logging.getLogger(__name__)


class _ActorGone(Exception):
    def __init__(self, replica: Replica, cause: Exception) -> None:
        super().__init__(str(cause))
        self.replica, self.cause = replica, cause


class ReplicaWatch:
    """Keeps a healthy replica set whole: every `watch_interval_s` one round trip asks every
    rank whether its process still runs; a replica with a dead rank is restarted (all its
    ranks, health waited for again) up to `max_restarts` times, then the set fails
    (`ReplicaSet.failure`, with the exit code and the log tail) instead of serving smaller.

    One thread per replica set, owned by it: `teardown` stops it.
    """

    def __init__(
        self,
        rs: ReplicaSet,
        options: ReplicaOptions,
        report: Callable[[str, dict[str, Any]], None] = lambda what, payload: None,
    ) -> None:
        self.rs = rs
        self.options = options
        self.report = report
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"prefect-nemo-replicas {rs.name}", daemon=True
        )

    def start(self) -> ReplicaWatch:
        """Start watching (the set must be healthy); returns self."""
        self.rs.__dict__["_watch"] = self
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching and wait for the thread (not from the thread itself)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self.options.readiness_timeout_s + 30)

    def _actors(self, replica: Replica) -> list[Any]:
        try:
            return [ray.get_actor(name, namespace=NAMESPACE) for name in replica.actors]
        except ValueError as exc:  # no actor by that name any more
            raise _ActorGone(replica, exc) from None

    def _run(self) -> None:
        while not self._stop.wait(self.options.watch_interval_s):
            try:
                dead = self._dead_replica()
            except _ActorGone as gone:  # its node went away: nothing left to restart it in
                self._fail(
                    gone.replica,
                    None,
                    f"replica {gone.replica.index} ({gone.replica.endpoint}) lost its Ray actor "
                    f"(its node or worker died): {gone.cause}",
                )
                return
            except Exception as exc:  # Ray briefly unreachable: ask again next round
                log.debug("watching %s: %s", self.rs.name, exc)
                continue
            if dead is None:
                continue
            replica, code, tail = dead
            if replica.restarts >= self.options.max_restarts:
                self._fail(
                    replica,
                    code,
                    f"replica {replica.index} ({replica.endpoint}) exited with code {code} after "
                    f"{replica.restarts} restart(s) (max_restarts={self.options.max_restarts}); "
                    f"last log lines:\n{tail}",
                )
                return
            try:
                self._restart(replica)
            except Exception as exc:
                self._fail(
                    replica,
                    code,
                    f"replica {replica.index} ({replica.endpoint}) exited with code {code} and "
                    f"could not be restarted: {exc}; last log lines:\n{tail}",
                )
                return

    def _fail(self, replica: Replica, code: int | None, message: str) -> None:
        self.rs.failure = ReplicaFailed(message)
        self.report("failed", {"replica": replica.index, "exit_code": code})

    def _dead_replica(self) -> tuple[Replica, int | None, str] | None:
        """The first replica with a rank whose process ended: (replica, exit code, log tail);
        _ActorGone when a replica's actor itself is gone."""
        pairs = [(r, a) for r in self.rs.replicas for a in self._actors(r)]
        try:
            alive = ray.get([a.is_alive.remote() for _, a in pairs], timeout=30)
        except RayActorError:  # one round trip failed: find whose actor it was
            for replica, actor in pairs:
                try:
                    ray.get(actor.is_alive.remote(), timeout=30)
                except RayActorError as exc:
                    raise _ActorGone(replica, exc) from None
            raise
        for (replica, actor), up in zip(pairs, alive, strict=True):
            if not up:
                code, tail = ray.get(
                    [actor.exit_code.remote(), actor.read_log_tail.remote()], timeout=30
                )
                return replica, code, tail
        return None

    def _restart(self, replica: Replica) -> None:
        """Stop every rank of the replica, start them again as they were, wait for health."""
        actors = self._actors(replica)
        ray.get([a.stop.remote(self.options.stop_timeout_s) for a in actors], timeout=120)
        records = ray.get(
            [
                actor.start.remote(command, env=env, cwd=self.options.cwd)
                for actor, command, env in zip(actors, replica.commands, replica.envs, strict=True)
            ],
            timeout=120,
        )
        replica.pids = [r["pid"] for r in records]
        wait_healthy([replica], {replica.index: actors}, self.options.readiness_timeout_s)
        replica.restarts += 1  # counted once it serves again
        self.report("restarted", {"replica": replica.index, "restarts": replica.restarts})
