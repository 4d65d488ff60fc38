"""Seeing a run: metric trackers (TensorBoard, MLflow, W&B), the end-of-run summary table, progress bars,
the table listing behind ``batchrl inspect RUN``, and ``batchrl report`` (batchrl.tracking.report, which
imports matplotlib only when called).

metrics.jsonl is written by the runner itself (one line per iteration, rewritten whole, so a resume never
duplicates a line); trackers are extra sinks for the same per-iteration metrics.
"""

from batchrl.tracking.progress import ProgressBar, progress, stderr_console
from batchrl.tracking.summary import format_summary
from batchrl.tracking.tables import TableInfo, describe_run, run_tables
from batchrl.tracking.trackers import Tracker, Trackers, check_tracking, make_trackers, tracking_session

__all__ = [
    "ProgressBar",
    "TableInfo",
    "Tracker",
    "Trackers",
    "check_tracking",
    "describe_run",
    "format_summary",
    "make_trackers",
    "progress",
    "run_tables",
    "stderr_console",
    "tracking_session",
]
