"""The ``ray`` executor: each group of runs as a Ray task holding one GPU (or CPUs on CPU).

Ray sets ``CUDA_VISIBLE_DEVICES`` for each task, so the worker's ``cuda`` is the GPU it was given
and its energy sampler binds that GPU by UUID. A task streams its messages back as a Ray
streaming generator; the driver writes them (one writer). Tasks are never retried by Ray: a
worker that dies is charged for its run in flight by the driver, which sends the rest of the
group to a fresh task. At most one task per GPU (or per ``threads`` CPUs) is in flight, so each
task starts with the budget the sweep has left.

``ray`` is an optional extra (``pip install 'kvlab[ray]'``), imported only here.
"""

from __future__ import annotations

import queue
import threading
import traceback
from collections.abc import Callable, Iterator

from kvlab.runner.drive import WorkerDied, drive, shape_groups
from kvlab.runner.worker import GroupJob, run_job

INSTALL_HINT = "executor: ray needs the ray package; install it with pip install 'kvlab[ray]'"


def import_ray():
    """``ray``, or one ImportError naming the extra to install."""
    try:
        import ray
    except ImportError as err:
        raise ImportError(f"{INSTALL_HINT} ({err})") from None
    return ray


def group_stream(job: GroupJob) -> Iterator[tuple]:
    """The task body: measure in a thread and yield its messages as they come (a Ray streaming
    generator sends each to the driver at once, so a crash loses nothing already measured)."""
    inbox: queue.Queue = queue.Queue()
    done = object()

    def body():
        try:
            run_job(job, inbox.put, executor="ray")
        except BaseException as err:
            inbox.put(("fatal", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
        finally:
            inbox.put(done)

    thread = threading.Thread(target=body, name="kvlab-ray-group", daemon=True)
    thread.start()
    while (msg := inbox.get()) is not done:
        yield msg
    thread.join()


def task_resources(params) -> dict[str, float]:
    """One whole GPU per task on CUDA (never a fraction: sharing a GPU corrupts power and latency),
    else ``threads`` CPUs (1 when unset)."""
    if str(params.device).startswith("cuda"):
        return {"num_gpus": 1, "num_cpus": 1}
    return {"num_cpus": params.threads or 1}


def slots_for(resources: dict[str, float], cluster: dict[str, float]) -> int:
    """How many tasks the cluster holds at once (at least 1: Ray queues the rest)."""
    if resources.get("num_gpus"):
        return max(1, int(cluster.get("GPU", 0) // resources["num_gpus"]))
    return max(1, int(cluster.get("CPU", 0) // resources["num_cpus"]))


class RayExecutor:
    name = "ray"

    def __init__(self, address: str | None = None, log: Callable[[str], None] = print):
        self.ray = import_ray()
        self.address = address
        self.log = log

    def _connect(self) -> bool:
        """Join the cluster at ``address`` (or RAY_ADDRESS, else a local one); True if we started it."""
        ray = self.ray
        if ray.is_initialized():
            return False
        ray.init(address=self.address, include_dashboard=False, log_to_driver=True)
        return True

    def transport(self, params) -> Callable[[GroupJob], Iterator[tuple]]:
        ray = self.ray
        remote = ray.remote(num_returns="streaming", max_retries=0)(group_stream)
        task = remote.options(**task_resources(params))

        def run(job: GroupJob) -> Iterator[tuple]:
            try:
                for ref in task.remote(job):
                    msg = ray.get(ref)
                    if msg[0] == "fatal":
                        raise WorkerDied(msg[1])
                    yield msg
            except ray.exceptions.RayError as err:
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise WorkerDied(f"{type(err).__name__}: {first}") from None

        return run

    def run(self, params, pending, sink, budget, *, sweep_name, loader, sampler_factory) -> None:
        started = self._connect()
        try:
            resources = task_resources(params)
            cluster = self.ray.cluster_resources()
            if resources.get("num_gpus") and not cluster.get("GPU"):
                raise ValueError(f"device: {params.device!r} but the Ray cluster has no GPU "
                                 f"(resources: {cluster}); start its nodes with GPUs, or --set device=cpu")
            slots = slots_for(resources, cluster)
            sink.log(f"kvlab sweep: ray executor, {slots} task(s) at a time with {resources} each")
            drive(shape_groups(pending), self.transport(params), slots=slots, params=params, sink=sink,
                  budget=budget, sweep_name=sweep_name, loader=loader, sampler_factory=sampler_factory)
        finally:
            if started:
                self.ray.shutdown()
