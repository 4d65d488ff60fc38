"""Model-based reward: a Hugging Face ``AutoModelForSequenceClassification`` with one output (a reward model).

The score of a sample is the model's single logit for the text ``prompt_text + response`` (input_format
"concat": prompt_text already carries the policy's chat template) or for the reward model's own chat template
applied to the prompt messages plus ``{"role": "assistant", "content": response}`` (input_format "chat").
Special tokens come from that text only (``add_special_tokens=False``), so nothing is added twice.

Batching: samples are sorted by token count and padded on the right to the longest of each batch of
`batch_size`; with right padding every real token keeps its position, so a batched score equals the score of
the text alone (up to float rounding). The logit is read, as in transformers, at the last token that is not
the pad token; a model without ``pad_token_id`` gets the tokenizer's. A text longer than `max_length` tokens
keeps its LAST max_length tokens (the end of the response is what is being judged) and is counted.

Departures from verl: verl's reward model worker re-tokenises with the RM's chat template only ("chat" here)
and takes the logit at the last attention-mask position; the result is the same when the text does not end in
the pad token.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


class SequenceClassifierReward:
    """Loads the reward model once; ``score(...)`` returns one float per sample and the number truncated."""

    def __init__(
        self,
        *,
        path: str,
        tokenizer: str | None = None,
        batch_size: int = 8,
        max_length: int | None = None,
        input_format: str = "concat",
        dtype: str = "auto",
        trust_remote_code: bool = False,
        device: str | None = None,
    ):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer or path, trust_remote_code=trust_remote_code)
        torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=torch_dtype, trust_remote_code=trust_remote_code
        )
        if self.model.config.num_labels != 1:
            raise ValueError(
                f"reward model {path} has num_labels={self.model.config.num_labels}; a reward model "
                "must output one score (num_labels=1)"
            )
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model.to(self.device).eval()
        self.pad_token_id = self._pad_token_id(path)
        self.batch_size, self.input_format = batch_size, input_format
        self.max_length = max_length or getattr(self.model.config, "max_position_embeddings", None)

    def _pad_token_id(self, path: str) -> int:
        pad_id = self.model.config.pad_token_id
        if pad_id is None:
            pad_id = self.tokenizer.pad_token_id
            if pad_id is None:
                raise ValueError(
                    f"reward model {path} and its tokenizer have no pad token; set pad_token_id in its config.json"
                )
            self.model.config.pad_token_id = pad_id
        return int(pad_id)

    def texts(
        self, *, prompt_texts: Sequence[str], messages_json: Sequence[str], responses: Sequence[str]
    ) -> list[str]:
        """The text scored for each sample, per input_format."""
        if self.input_format == "concat":
            return [p + r for p, r in zip(prompt_texts, responses, strict=True)]
        return [
            self.tokenizer.apply_chat_template([*json.loads(m), {"role": "assistant", "content": r}], tokenize=False)
            for m, r in zip(messages_json, responses, strict=True)
        ]

    def score(self, texts: Sequence[str]) -> tuple[np.ndarray, int]:
        """scores_S (float32) and how many texts were cut to max_length tokens."""
        import torch

        token_ids = self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
        num_truncated = 0
        if self.max_length:
            num_truncated = sum(len(ids) > self.max_length for ids in token_ids)
            token_ids = [ids[-self.max_length :] for ids in token_ids]
        order = np.argsort([len(ids) for ids in token_ids], kind="stable")
        scores_S = np.zeros(len(token_ids), dtype=np.float32)
        with torch.inference_mode():
            for start in range(0, len(order), self.batch_size):
                batch = order[start : start + self.batch_size]
                input_ids_BT, attention_mask_BT = self._pad([token_ids[i] for i in batch])
                logits_B1 = self.model(input_ids=input_ids_BT, attention_mask=attention_mask_BT).logits
                scores_S[batch] = logits_B1[:, 0].float().cpu().numpy()
        return scores_S, num_truncated

    def _pad(self, sequences: list[list[int]]) -> tuple[Any, Any]:
        import torch

        length = max(len(s) for s in sequences)
        input_ids_BT = torch.full((len(sequences), length), self.pad_token_id, dtype=torch.long)
        attention_mask_BT = torch.zeros((len(sequences), length), dtype=torch.long)
        for row, ids in enumerate(sequences):
            input_ids_BT[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention_mask_BT[row, : len(ids)] = 1
        return input_ids_BT.to(self.device), attention_mask_BT.to(self.device)
