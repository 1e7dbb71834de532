"""The ``ray`` executor: each group of runs as a Ray task holding one GPU (or CPUs on CPU).

Ray sets ``CUDA_VISIBLE_DEVICES`` for each task, so the worker's ``cuda`` is the GPU it was given
and its energy sampler binds that GPU by UUID. A task puts each message into a mailbox actor and
waits for the put to land, so whatever a worker measured before it died is safe (a streaming
generator's in-flight items are not); the driver empties the mailbox and writes (one writer).
Each task gets a fresh worker process and is never retried by Ray: a worker that dies is charged
for what it was doing by the driver (:func:`kvlab.runner.drive.charged_runs`), which sends the rest of the group to a fresh task. At most
one task per GPU (or per ``threads`` CPUs) is in flight, so each task starts with the budget the
sweep has left.

``ray`` is an optional extra (``pip install 'kvlab[ray]'``), imported only here.
"""

from __future__ import annotations

import os
import traceback
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator

from kvlab.errors import UserError
from kvlab.runner.drive import WorkerDied, drive, shape_groups
from kvlab.runner.worker import GroupJob, run_job

INSTALL_HINT = "executor: ray needs the ray package; install it with pip install 'kvlab[ray]'"
POLL_S = 0.2
def import_ray():
    """``ray``, or one ImportError naming the extra to install."""
    try:
        import ray
    except ImportError as err:
        raise ImportError(f"{INSTALL_HINT} ({err})") from None
    return ray


class Mailbox:
    """A driver-side actor holding each group's messages until the driver takes them."""

    def __init__(self):
        self.boxes: dict[str, list[tuple]] = defaultdict(list)

    def put(self, gid: str, msg: tuple) -> None:
        self.boxes[gid].append(msg)

    def take(self, gid: str) -> list[tuple]:
        return self.boxes.pop(gid, [])


def group_task(job: GroupJob, mailbox, gid: str) -> None:
    """The task body: measure the group, each message acknowledged by the mailbox before going on."""
    import ray

    def send(msg: tuple) -> None:
        ray.get(mailbox.put.remote(gid, msg))

    try:
        run_job(job, send, executor="ray")
    except BaseException as err:
        send(("fatal", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))


def task_resources(params, cluster: dict[str, float] | None = None) -> dict[str, float]:
    """One whole GPU per task on CUDA (never a fraction: sharing a GPU corrupts power and latency)
    with its share of the cluster's CPUs (``threads`` if set), else ``threads`` CPUs (1 when unset).

    Why a GPU task takes its CPU share: Ray gives a task ``OMP_NUM_THREADS = num_cpus``, and at
    batch 1 the ``hf`` step is bound by the host: on the H200 a task asking for 1 CPU ran with one
    torch thread and 1.36x local's ms/step.
    """
    if str(params.device).startswith("cuda"):
        cluster = cluster or {}
        share = int(cluster.get("CPU", 1) // max(1.0, cluster.get("GPU", 1)))
        return {"num_gpus": 1, "num_cpus": params.threads or max(1, share)}
    return {"num_cpus": params.threads or 1}


def slots_for(resources: dict[str, float], cluster: dict[str, float]) -> int:
    """How many tasks the cluster holds at once (at least 1: Ray queues the rest)."""
    if resources.get("num_gpus"):
        return max(1, int(cluster.get("GPU", 0) // resources["num_gpus"]))
    return max(1, int(cluster.get("CPU", 0) // resources["num_cpus"]))


class RayExecutor:
    name = "ray"

    @classmethod
    def from_options(cls, *, ray_address: str | None = None, log=print):
        """The executor :func:`kvlab.runner.make_executor` makes from a sweep's options."""
        return cls(address=ray_address, log=log)

    def __init__(self, address: str | None = None, log: Callable[[str], None] = print):
        self.ray = import_ray()
        self.address = address
        self.log = log

    def _connect(self) -> bool:
        """Join the cluster at ``address`` (or RAY_ADDRESS, else a local one); True if we started it."""
        ray = self.ray
        if ray.is_initialized():
            return False
        address = self.address or os.environ.get("RAY_ADDRESS")
        if not address or address.strip() == "local":
            # none given: a running cluster on this machine, else a new local one; "local": always a new one
            ray.init(address=address.strip() if address else None, include_dashboard=False)
            return True
        try:
            ray.init(address=self.address)
        except ConnectionError as err:  # e.g. auto with no cluster on this machine: one line, not Ray's traceback
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise UserError(f"ray_address: {self.address or os.environ.get('RAY_ADDRESS')}: {first}") from None
        return True

    def transport(self, params, mailbox, resources: dict[str, float]) -> Callable[[GroupJob], Iterator[tuple]]:
        ray = self.ray
        # a fresh worker process per group (max_calls=1), as with `process`: nothing (a poisoned CUDA
        # context, leaked memory) carries over from one group to the next
        task = ray.remote(max_retries=0, max_calls=1)(group_task).options(**resources)

        def run(job: GroupJob) -> Iterator[tuple]:
            gid = uuid.uuid4().hex
            ref = task.remote(job, mailbox, gid)
            try:
                while True:
                    finished = bool(ray.wait([ref], timeout=POLL_S)[0])
                    for msg in ray.get(mailbox.take.remote(gid)):  # every put before `finished`
                        if msg[0] == "fatal":
                            raise WorkerDied(msg[1])
                        yield msg
                    if finished:
                        break
                ray.get(ref)
            except ray.exceptions.RayError as err:
                first = str(err).strip().splitlines()[0] if str(err).strip() else ""
                raise WorkerDied(f"{type(err).__name__}: {first}") from None
            finally:
                if not ray.wait([ref], timeout=0)[0]:  # the driver stopped listening: stop the task
                    ray.cancel(ref, force=True)

        return run

    def check(self, *, loader, sampler_factory) -> None:
        """Nothing to check before the lock: this executor takes any callables."""

    def _mailbox(self):
        """The mailbox actor, on the driver's node (where the records are written) when it can be."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = self.ray.get_runtime_context().get_node_id()
        return self.ray.remote(num_cpus=0, max_restarts=0)(Mailbox).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=True)).remote()

    def run(self, params, pending, sink, budget, *, sweep_name, loader, sampler_factory) -> None:
        started = self._connect()
        try:
            cluster = self.ray.cluster_resources()
            resources = task_resources(params, cluster)
            if resources.get("num_gpus") and not cluster.get("GPU"):
                raise UserError(f"device: {params.device!r} but the Ray cluster has no GPU "
                                 f"(resources: {cluster}); start its nodes with GPUs, or --set device=cpu")
            slots = slots_for(resources, cluster)
            sink.log(f"kvlab sweep: ray executor, {slots} task(s) at a time with {resources} each")
            mailbox = self._mailbox()
            drive(shape_groups(pending), self.transport(params, mailbox, resources), slots=slots, params=params, sink=sink,
                  budget=budget, sweep_name=sweep_name, loader=loader, sampler_factory=sampler_factory)
        finally:
            if started:
                self.ray.shutdown()
