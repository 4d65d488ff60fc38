"""Environments the environment tests play against (importable by the generate actors: tests/stages is on their
PYTHONPATH)."""

from __future__ import annotations

import random
import time

from batchrl.agents.environment import Step


class Countdown:
    """Answers each turn with how many are left and rewards the last one with its length in characters; the first
    observation says the prompt and a number drawn from the sample's seed (so that reruns must agree)."""

    def __init__(self, turns: int = 2, reward_each_turn: float | None = None):
        self.turns, self.reward_each_turn = turns, reward_each_turn
        self.left = turns

    def reset(self, row):
        self.left = self.turns
        draw = random.Random(row["sample_seed"]).randint(0, 99)
        return f"start {row['prompt_id']} {draw}"

    def step(self, action: str):
        self.left -= 1
        if self.left == 0:
            return Step(observation=None, reward=float(len(action)), done=True)
        return f"{self.left} left", self.reward_each_turn, False


class Endless(Countdown):
    """Never done: every turn is answered and rewarded with the turn's number."""

    def step(self, action: str):
        self.left -= 1
        return Step(observation="go on", reward=float(-self.left), done=False)


class FailsOnOddSamples(Countdown):
    """Its step raises for odd sample_idx (the other samples play on)."""

    def reset(self, row):
        self.odd = row["sample_idx"] % 2 == 1
        return super().reset(row)

    def step(self, action: str):
        if self.odd:
            raise RuntimeError("odd sample")
        return super().step(action)


class BadReset(Countdown):
    """reset returns a number instead of text: a broken contract, the sample's error."""

    def reset(self, row):
        return 42


def not_a_class(row):
    return None


class Slow(Countdown):
    """Each step sleeps ``seconds`` first (time.sleep releases the GIL, as waiting on a server would) and notes
    when it ran in ``Slow.spans`` as (turn, start, end)."""

    spans: list[tuple[int, float, float]] = []  # list.append is atomic: the threads share it safely

    def __init__(self, seconds: float = 0.5, **params):
        super().__init__(**params)
        self.seconds, self.turn = seconds, 0

    def step(self, action: str):
        start = time.monotonic()
        time.sleep(self.seconds)
        Slow.spans.append((self.turn, start, time.monotonic()))
        self.turn += 1
        return super().step(action)


class HangsOnSampleOne(Countdown):
    """Sample 1's first step never returns in time (it sleeps 10 s); the other samples play on."""

    def reset(self, row):
        self.hangs = row["sample_idx"] == 1
        return super().reset(row)

    def step(self, action: str):
        if self.hangs:
            time.sleep(10)
        return super().step(action)
