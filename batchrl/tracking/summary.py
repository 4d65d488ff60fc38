"""A compact per-iteration table of a run's key metrics, printed by the CLI at the end of a run.

Plain text, not a rich table: the same lines read well on a terminal and in a scheduler's log. Only the
columns some iteration has a value for are shown (no KL column when no KL is computed).
"""

from __future__ import annotations

import logging
import math

logger = logging.getLogger(__name__)

# (header, metric name); accuracy is the first val-core/* metric found, when evaluation produced one
COLUMNS = [
    ("iter", "iteration"),
    ("score", "critic/score/mean"),
    ("accuracy", "val-core/*"),
    ("resp_len", "response_length/mean"),
    ("tool_use", "tools/use_rate"),  # with generate.tools: share of samples that called a tool
    ("turns", "tools/turns_mean"),  # the policy's turns per sample
    ("pg_loss", "actor/pg_loss"),
    ("ppo_kl", "actor/ppo_kl"),
    ("kl_loss", "actor/kl_loss"),
    ("entropy", "actor/entropy"),
    ("grad_norm", "actor/grad_norm"),
    ("gen_s", "timing_s/gen"),
    ("update_s", "timing_s/update"),
    ("step_s", "timing_s/step"),
]


def format_summary(iterations: list[dict]) -> str:
    """One line per iteration (metrics as in metrics.jsonl), a header above; "" for no iteration."""
    if not iterations:
        return ""
    columns = []
    for header, key in COLUMNS:
        if key.endswith("/*"):  # greedy accuracy (mean@1) when evaluated, else the first metric of the family
            found = sorted({k for m in iterations for k in m if k.startswith(key[:-1])})
            key = next((k for k in found if k.endswith("/mean@1")), found[0] if found else "")
        if key and any(m.get(key) is not None for m in iterations):
            columns.append((header, key))
    cells = [[header for header, _ in columns]]
    cells += [[_format(m.get(key)) for _, key in columns] for m in iterations]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in cells)


def _format(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.4g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"
    return str(value)
