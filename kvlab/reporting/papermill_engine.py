"""``papermill --engine kvlab``: papermill's own nbclient engine with the kernel on IPC, not TCP.

ipykernel 7 warns "Kernel is running over TCP without encryption" at every kernel start, and
papermill's CLI prints it (the H200's papermill runs of notebooks/sweep.ipynb did). It is
not kvlab's warning and not a risk here (a local kernel papermill starts and stops), so the README's
papermill commands pick this engine to silence it: the same IPC kernel manager `kvlab report` uses
(:func:`kvlab.reporting.render.ipc_kernel_manager`). Registered as an entry point in pyproject.toml
(``papermill.engine``); everything else is papermill's default engine.
"""

from __future__ import annotations

from papermill.engines import NBClientEngine

from kvlab.reporting.render import ipc_kernel_manager


class IPCEngine(NBClientEngine):
    """:class:`papermill.engines.NBClientEngine` whose kernel talks over IPC (socket files in
    Jupyter's runtime folder) unless the caller passes its own ``kernel_manager_class``."""

    @classmethod
    def execute_managed_notebook(cls, nb_man, kernel_name, **kwargs):
        kwargs.setdefault("kernel_manager_class", ipc_kernel_manager())
        return super().execute_managed_notebook(nb_man, kernel_name, **kwargs)
