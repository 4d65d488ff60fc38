"""Length shaping terms: penalties that read the per-sample row fields ``response_length`` / ``finish_reason``.

Both are meant as extra terms in ``score.rewards`` next to a correctness reward, with their settings in the
term's ``params`` (passed as keyword arguments), e.g.::

    score:
      rewards:
        - {reward: math}
        - {reward: overlong_penalty, params: {max_length: 1024, buffer_length: 256}}

overlong_penalty is the reward-term form of ``batchrl.algorithms.advantages.overlong_penalty``, DAPO's soft
overlong punishment (Yu et al. 2025, eq. 13), as verl's ``overlong_buffer``:
no penalty up to ``max_length - buffer_length`` tokens, then a linear ramp down to ``-penalty_factor`` at
``max_length``. Departure from verl: the penalty is clamped at ``-penalty_factor`` beyond ``max_length`` (verl
keeps ramping; the generation cap normally makes the two agree). Lengths are in tokens (``response_lengths``).
"""

from __future__ import annotations

import logging
from typing import Any

from batchrl.algorithms.advantages import overlong_penalty as overlong_penalty_of_lengths
from batchrl.rewards.labels import label_free

logger = logging.getLogger(__name__)


@label_free
def overlong_penalty(
    response: str,
    ground_truth: str | None = None,
    *,
    response_length: int,
    max_length: int,
    buffer_length: int,
    penalty_factor: float = 1.0,
    **row: Any,
) -> float:
    """Registry reward "overlong_penalty": 0 when short enough, down to -penalty_factor at max_length tokens."""
    if not 0 < buffer_length <= max_length:
        raise ValueError(
            f"overlong_penalty needs 0 < buffer_length ({buffer_length}) <= max_length ({max_length}); "
            "fix the term's params"
        )
    penalty = overlong_penalty_of_lengths(
        response_length,
        max_response_length=max_length,
        overlong_buffer_len=buffer_length,
        penalty_factor=penalty_factor,
    )
    return float(penalty)


@label_free
def truncation_penalty(
    response: str, ground_truth: str | None = None, *, finish_reason: str, penalty: float = -1.0, **row: Any
) -> float:
    """Registry reward "truncation_penalty": `penalty` for a sample cut off by the length cap, else 0.0."""
    return float(penalty) if finish_reason == "length" else 0.0
