"""An OpenAI-compatible chat completions client: a judge (or any model) reached over HTTP.

Why the standard library (urllib, a thread pool) and not an SDK: a request is one JSON POST, and the behaviours that
matter for a batch job are ours to choose, not a client library's defaults: at most ``max_concurrency`` requests in
flight, a deadline per request, and retries with exponential backoff on what a busy server answers (HTTP 429, 5xx, a
timeout, a refused connection) but never on a request the server rejected (4xx: retrying cannot help). A request
that still fails is a per-request error the caller records; it never raises, so one bad sample does not fail a shard.
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

RETRIED_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})
MAX_ERROR_CHARS = 300


@dataclass(frozen=True)
class ChatResult:
    text: str  # the first choice's message content ("" when the request failed)
    completion_tokens: int  # as the server counts them (0 when it does not say)
    error: str | None = None  # why no text came back, after the retries


class ChatClient:
    """Sends chat requests to ``<base_url>/chat/completions``, ``max_concurrency`` at a time."""

    def __init__(
        self,
        *,
        base_url: str,
        model: str,
        api_key_env: str | None = None,
        max_concurrency: int = 8,
        timeout_s: float = 60.0,
        max_request_retries: int = 4,
        backoff_s: float = 1.0,
    ):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.headers = {"Content-Type": "application/json"}
        if api_key_env:  # read here, in the actor, so the key never travels in the config or a table
            key = os.environ.get(api_key_env)
            if not key:
                raise ValueError(f"judge.endpoint.api_key_env={api_key_env!r} is not set in the environment")
            self.headers["Authorization"] = f"Bearer {key}"
        self.max_concurrency = max_concurrency
        self.timeout_s = timeout_s
        self.max_request_retries = max_request_retries
        self.backoff_s = backoff_s

    def complete(self, conversations: list[list[dict[str, str]]], *, seeds: list[int], sampling: dict) -> list:
        """One ChatResult per conversation, in order; ``sampling``: temperature, top_p, max_tokens."""
        with ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="chat-http") as pool:
            futures = [pool.submit(self._one, messages, seed, sampling) for messages, seed in zip(conversations, seeds)]
            return [future.result() for future in futures]

    def _one(self, messages: list[dict[str, str]], seed: int, sampling: dict) -> ChatResult:
        body = json.dumps({"model": self.model, "messages": messages, "seed": seed, **sampling}).encode()
        error = ""
        for attempt in range(self.max_request_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                request = urllib.request.Request(self.url, data=body, headers=self.headers, method="POST")
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    return _result(json.loads(response.read()))
            except urllib.error.HTTPError as err:
                error = f"HTTP {err.code}: {_body(err)}"
                if err.code not in RETRIED_STATUS:
                    break
            except TimeoutError:
                error = f"no answer within {self.timeout_s:g} s"
            except (urllib.error.URLError, ConnectionError) as err:
                error = f"cannot reach {self.url}: {getattr(err, 'reason', err)}"
            except (ValueError, KeyError, IndexError, TypeError) as err:  # 200 with a body that is no completion
                error = f"not a chat completion: {type(err).__name__}: {err}"
                break
            logger.debug("chat request attempt %d failed: %s", attempt + 1, error)
        return ChatResult(text="", completion_tokens=0, error=error[:MAX_ERROR_CHARS])


def _result(payload: dict[str, Any]) -> ChatResult:
    content = payload["choices"][0]["message"]["content"]
    if not isinstance(content, str):
        raise TypeError(f"message content is {type(content).__name__}")
    tokens = (payload.get("usage") or {}).get("completion_tokens") or 0
    return ChatResult(text=content, completion_tokens=int(tokens))


def _body(err: urllib.error.HTTPError) -> str:
    try:
        return err.read().decode(errors="replace")[:MAX_ERROR_CHARS]
    except OSError:
        return err.reason or ""
