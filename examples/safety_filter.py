"""A safety cost filter, inserted after score: rewards of responses below a safety threshold become 0, and the rows
are flagged.

The "cost model" is a word list here, so the example runs anywhere; a real one would load a classifier in
``__init__`` (built once per actor) and score ``response_texts`` in ``__call__``. The stage's table keeps the safety
score and the flag of every sample for inspection (`batchrl inspect <run> --table safety`); advantage then reads
the zeroed rewards.

    stages:
      - name: safety
        after: score
        call: examples.safety_filter:SafetyFilter
        params: {banned_words: [password, exploit], min_safety: 0.9}
        outputs: [scores, safety_scores, unsafe]
"""

from __future__ import annotations

import pyarrow as pa


class SafetyFilter:
    """safety = 1 - the share of a response's words that are banned; below ``min_safety`` the reward becomes 0."""

    def __init__(self, *, banned_words: list[str], min_safety: float = 0.9):
        self.banned = {word.lower() for word in banned_words}  # a classifier would be loaded here, once per actor
        self.min_safety = min_safety

    def safety(self, text: str) -> float:
        words = text.lower().split()
        return 1.0 - sum(word.strip(".,!?") in self.banned for word in words) / max(len(words), 1)

    def __call__(self, table: pa.Table) -> pa.Table:
        safety = [[self.safety(text) for text in texts] for texts in table.column("response_texts").to_pylist()]
        unsafe = [[value < self.min_safety for value in group] for group in safety]
        scores = [
            [0.0 if flagged else score for score, flagged in zip(group_scores, group_flags)]
            for group_scores, group_flags in zip(table.column("scores").to_pylist(), unsafe)
        ]
        table = table.set_column(table.schema.get_field_index("scores"), "scores", pa.array(scores))
        return table.append_column("safety_scores", pa.array(safety)).append_column("unsafe", pa.array(unsafe))
