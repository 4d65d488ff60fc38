"""Prompt-aware reward shaping, inserted after score: a response longer than its prompt's budget loses reward in
proportion to the excess.

The budget depends on the prompt: ``tokens_per_prompt_token`` x the prompt's length, at least ``min_budget``
tokens, so a short question earns a short answer and a long one may take longer. A plain function: it needs no
setup, and its params come as keyword arguments.

    stages:
      - name: shaping
        after: score
        call: examples.prompt_shaping:shape_by_prompt_length
        params: {tokens_per_prompt_token: 0.5, min_budget: 4, penalty_per_token: 0.05}
        outputs: [scores, length_penalties]
"""

from __future__ import annotations

import pyarrow as pa


def shape_by_prompt_length(
    table: pa.Table, *, tokens_per_prompt_token: float, min_budget: int, penalty_per_token: float
) -> pa.Table:
    """scores - penalty_per_token x (response tokens beyond the prompt's budget), per sample."""
    penalties = []
    for prompt, lengths in zip(
        table.column("prompt_token_ids").to_pylist(), table.column("response_lengths").to_pylist()
    ):
        budget = max(min_budget, tokens_per_prompt_token * len(prompt))
        penalties.append([penalty_per_token * max(0.0, length - budget) for length in lengths])
    scores = [
        [score - penalty for score, penalty in zip(group_scores, group_penalties)]
        for group_scores, group_penalties in zip(table.column("scores").to_pylist(), penalties)
    ]
    table = table.set_column(table.schema.get_field_index("scores"), "scores", pa.array(scores))
    return table.append_column("length_penalties", pa.array(penalties))
