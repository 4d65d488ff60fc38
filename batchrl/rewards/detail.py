"""A reward value with a note for the scores table: what went wrong in a sample that still got a value.

A code reward gives a partly right program 0.6 and should say why the rest failed (a timeout, a crash, its
stderr); that is not a failure of the reward (``score_errors``, ``failure_reward``), so it goes to its own column,
``score_details``. Why a float subclass rather than a second return value: every reward keeps the one contract,
``fn(...) -> float | None``, and code that treats the value as a float (tests, user stages) is unaffected.
"""

from __future__ import annotations


class RewardWithDetail(float):
    """``RewardWithDetail(0.5, "test 2: timeout")``: a float that also carries ``detail`` (a short string)."""

    detail: str

    def __new__(cls, value: float, detail: str) -> RewardWithDetail:
        self = super().__new__(cls, value)
        self.detail = detail
        return self

    def __reduce__(self) -> tuple:  # crosses the pipe from the reward process with its detail
        return (RewardWithDetail, (float(self), self.detail))

    def __repr__(self) -> str:
        return f"RewardWithDetail({float(self)!r}, {self.detail!r})"
