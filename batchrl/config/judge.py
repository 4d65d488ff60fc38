"""The judge section: an LLM that grades each response, as its own stage between generate and score.

The judge is a different model than the policy, served by engines of its own (or reached over an OpenAI-compatible
HTTP endpoint): its verdicts are a table (judgements) that score reads through the built-in reward term ``judge``.
What belongs here is what decides a verdict (the model, the template, the sampling, the parser and the retries);
where it runs (actors, concurrency, timeouts) is ``Placement`` and changes no table.
"""

from __future__ import annotations

import string
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from batchrl.config.base import ActorResources, Placement, _Strict

# The row fields a judge template may name: {prompt} (the text of the prompt's messages), {response} (one sample),
# {ground_truth} (the row's reference answer), {rubric} (extra_info[judge.rubric_key]), {data_source}, {prompt_id}.
TEMPLATE_FIELDS = ("prompt", "response", "ground_truth", "rubric", "data_source", "prompt_id")


def template_fields(template: str) -> list[str]:
    """The field names ``template`` names ({name}; {{ and }} are literal braces); ValueError on a malformed one."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as err:
        raise ValueError(f"{err} (write a literal brace as {{{{ or }}}})") from None
    names = []
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if name not in TEMPLATE_FIELDS or spec or conversion:
            raise ValueError(
                f"{{{name}{'!' + conversion if conversion else ''}{':' + spec if spec else ''}}} is not a field a "
                f"judge template may name: use {', '.join('{' + f + '}' for f in TEMPLATE_FIELDS)} (write a literal "
                "brace as {{ or }})"
            )
        names.append(name)
    return names


class NumberVerdict(_Strict):
    """A number in [min, max]: the last number in the judge's text (or the first group of ``pattern``)."""

    kind: Literal["number"] = "number"
    min: float = Field(0.0, description="Lowest valid verdict; a number below it is unparsable.")
    max: float = Field(10.0, description="Highest valid verdict; a number above it is unparsable.")
    normalize: bool = Field(True, description="Map [min, max] onto [0, 1] (the verdict score written).")
    pattern: str | None = Field(
        None,
        description="A regular expression whose first group is the number (its last match counts), e.g. "
        "'Score: *([0-9.]+)'; default: the last number in the text.",
    )

    @model_validator(mode="after")
    def _range(self) -> NumberVerdict:
        if not self.min < self.max:
            raise ValueError(f"min={self.min} must be below max={self.max}")
        return self


class LetterVerdict(_Strict):
    """A grade from a fixed set (A/B/C, PASS/FAIL...): the last one in the text (or ``pattern``'s group), mapped."""

    kind: Literal["letter"] = "letter"
    grades: dict[str, float] = Field(
        ...,
        min_length=1,
        description="Grade -> score, e.g. {A: 1.0, B: 0.5, C: 0.0}; matched as a whole word, case-sensitively.",
    )
    pattern: str | None = Field(
        None, description="A regular expression whose first group is the grade (its last match counts)."
    )


class JsonVerdict(_Strict):
    """A JSON object in the text (fenced or bare; the last one that parses) with a numeric value at ``key``."""

    kind: Literal["json"] = "json"
    key: str = Field("score", min_length=1, description="The key of the verdict in the object.")
    min: float | None = Field(None, description="Lowest valid verdict (null: unbounded).")
    max: float | None = Field(None, description="Highest valid verdict (null: unbounded).")


Verdict = Annotated[NumberVerdict | LetterVerdict | JsonVerdict, Field(discriminator="kind")]


class JudgeEndpoint(_Strict):
    """An OpenAI-compatible chat completions server (vLLM serve, SGLang, a hosted API) that plays the judge."""

    base_url: str = Field(
        ..., description="The API's base URL, e.g. http://judge:8000/v1 (requests go to <base_url>/chat/completions)."
    )
    model: str = Field(..., min_length=1, description="The model name sent in each request.")
    api_key_env: Placement[str | None] = Field(
        None, description="The environment variable holding the API key (sent as a Bearer token); null: none."
    )
    max_concurrency: Placement[int] = Field(8, ge=1, description="Requests in flight at once, per judge actor.")
    timeout_s: Placement[float] = Field(60.0, gt=0, description="Deadline of one request, in seconds.")
    max_request_retries: Placement[int] = Field(
        4,
        ge=0,
        description="Retries of a request that timed out, failed to connect or got HTTP 429 / 5xx, with exponential "
        "backoff; past them the sample's verdict fails with error kind 'request'.",
    )
    backoff_s: Placement[float] = Field(1.0, ge=0, description="The first retry's wait; each next one doubles it.")

    @field_validator("base_url")
    @classmethod
    def _http(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{url!r} must start with http:// or https://")
        return url.rstrip("/")


class JudgeConfig(ActorResources):
    """An LLM judge (the judge stage): each response is rendered into ``template``, judged, and its verdict parsed
    into a score that score.rewards uses through a term ``{reward: judge}``. num_actors actors each hold a judge
    engine (or an HTTP client of ``endpoint``)."""

    model: str | None = Field(
        None,
        description="The judge model: a local directory or hub id (as model.path), served by the judge's own engines; "
        "or set endpoint instead.",
    )
    endpoint: JudgeEndpoint | None = Field(None, description="An OpenAI-compatible HTTP judge instead of model.")
    engine: Literal["auto", "vllm", "hf"] = Field("auto", description="Judge engine, as generate.engine.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="Judge weights dtype.")
    max_model_len: int | None = Field(None, ge=1, description="Judge context length (vLLM); default the model's.")
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM tensor parallelism per judge actor (GPUs).")
    gpu_memory_utilization: Placement[float] = Field(
        0.85, gt=0, le=1.0, description="vLLM GPU memory fraction per judge actor."
    )
    enforce_eager: Placement[bool] = Field(True, description="Disable CUDA graphs in the judge's vLLM engine.")
    trust_remote_code: bool = Field(False, description="Allow custom modelling code from the judge checkpoint.")
    template: str = Field(
        ...,
        min_length=1,
        description="The judge's prompt, with {prompt}, {response}, {ground_truth}, {rubric}, {data_source}, "
        "{prompt_id} replaced by the sample's (write a literal brace as {{ or }}).",
    )
    system_prompt: str | None = Field(None, description="A system message before the template (chat only).")
    apply_chat_template: bool = Field(
        True,
        description="Render the messages with the judge tokenizer's chat template (engines; an endpoint always "
        "receives messages).",
    )
    rubric_key: str = Field("rubric", min_length=1, description="The extra_info key {rubric} reads.")
    temperature: float = Field(0.0, ge=0, description="Judge sampling temperature; 0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Judge nucleus sampling mass.")
    max_new_tokens: int = Field(256, ge=1, description="Judge tokens per verdict.")
    verdict: Verdict = Field(
        default_factory=NumberVerdict,
        description="How a score is read from the judge's text: {kind: number, min, max}, {kind: letter, grades: "
        "{A: 1, B: 0}} or {kind: json, key: score}.",
    )
    max_retries: int = Field(
        2,
        ge=0,
        description="Judge calls after an unparsable verdict, each with another seed and retry_temperature. Past "
        "them the verdict is null with error kind 'unparsable'.",
    )
    retry_temperature: float = Field(
        0.7,
        ge=0,
        description="Sampling temperature of the retries: a greedy judge asked again would write the same text, so "
        "a retry samples (its seed makes it reproducible).",
    )

    @field_validator("template")
    @classmethod
    def _known_fields(cls, template: str) -> str:
        if "response" not in template_fields(template):
            raise ValueError("the template must contain {response}, the answer the judge grades")
        return template

    @model_validator(mode="after")
    def _one_judge(self) -> JudgeConfig:
        if (self.model is None) == (self.endpoint is None):
            raise ValueError("set exactly one of judge.model (a model served by the judge's engines) or judge.endpoint")
        if self.endpoint is not None and self.gpus_per_actor:
            raise ValueError(f"judge.gpus_per_actor={self.gpus_per_actor} with an endpoint: an HTTP judge needs no GPU")
        return self


def judge_sharing_problem(judge: JudgeConfig, *, generate: Any, run: Any, update: Any) -> str | None:
    """Why a judge on GPUs would share them with the policy (None: it would not). The policy's engines keep their GPU
    between stages (generate.engine_lifetime run or sleep), so a judge needs whole GPUs of its own: a fraction lets
    Ray place it on a policy engine's GPU. With run.max_staleness the update's local ranks take GPUs outside Ray's
    view while the judge could run."""
    if not judge.gpus_per_actor or not generate.gpus_per_actor:
        return None
    if judge.gpus_per_actor % 1 or generate.gpus_per_actor % 1:
        return (
            f"judge.gpus_per_actor={judge.gpus_per_actor} with generate.gpus_per_actor={generate.gpus_per_actor} "
            "would let Ray put the judge on a GPU the policy's engines hold; give both whole GPUs (1, 2, ...) or run "
            "the judge on CPUs (judge.gpus_per_actor: 0) or behind judge.endpoint"
        )
    if run.max_staleness and update.launcher != "ray":
        return (
            f"judge.gpus_per_actor={judge.gpus_per_actor} with run.max_staleness={run.max_staleness}: the update's "
            "local ranks take GPUs that Ray would also give the judge; set update.launcher: ray, run.max_staleness: "
            "0, or use judge.endpoint"
        )
    return None


def judge_term_problem(judge: JudgeConfig | None, *, terms: list[Any]) -> str | None:
    """Why the judge section and score's ``judge`` term do not go together (None: they do)."""
    uses = [t for t in terms if t.reward == "judge"]
    if judge is not None and not uses:
        return "judge is set but no score.rewards term reads its verdicts: add {reward: judge, weight: 1.0}"
    if judge is None and uses:
        return "score.rewards has a term with reward: judge but there is no judge section to make its verdicts"
    return None
