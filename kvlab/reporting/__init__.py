"""The study report, one job per module: ``frames`` (which records, derived columns), ``stats``
(intervals from kvlab.intervals, grouped summaries), ``cards`` (which card measured each record),
``summaries`` (the report's answers), ``anatomy_files``, ``provenance``, ``study`` (loading a folder), ``notebook_params`` (the sweep notebook's params) and
``render`` (papermill + nbconvert to offline HTML). :mod:`kvlab.report` re-exports the public names
the notebooks and tests use.
"""

from kvlab.errors import UserError


class ReportError(UserError):
    """A records folder or notebook the report cannot use; the message names the fix."""
