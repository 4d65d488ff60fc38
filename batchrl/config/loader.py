"""Loading a pipeline: YAML file + conf/ profiles + ``--set a.b=c`` overrides -> PipelineConfig.

Precedence, lowest first: profiles (in the order listed), the pipeline file, ``--set`` overrides.
Errors are ``ConfigError`` with one line per problem naming the field, so the CLI can print them and exit 2.
Loading reads only the pipeline and profile files; it never touches data, object storage or a GPU.
"""

from __future__ import annotations

import copy
import difflib
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from batchrl.config.models import PipelineConfig
from batchrl.errors import ConfigError


def load_pipeline(path: str | os.PathLike, *, overrides: list[str] = (), run_id: str | None = None) -> PipelineConfig:
    path = Path(path)
    raw = _read_yaml(path)
    for override in overrides:
        apply_override(raw, override)
    profile_names = raw.get("profiles") or []
    if not isinstance(profile_names, list):
        raise ConfigError("profiles: must be a list of conf/ profile names, e.g. [engine/vllm_cpu]")
    merged: dict[str, Any] = {}
    for name in profile_names:
        merged = deep_merge(merged, _read_yaml(_find_profile(name, pipeline_path=path), what=f"profile {name}"))
    merged = deep_merge(merged, raw)
    if run_id is not None:
        merged.setdefault("run", {})["id"] = run_id
    set_by = {tuple(o.partition("=")[0].strip().split(".")): f"--set {o}" for o in overrides}
    return validate_dict(merged, source=str(path), set_by=set_by)


def validate_dict(
    raw: dict[str, Any], *, source: str = "<config>", set_by: dict[tuple[str, ...], str] | None = None
) -> PipelineConfig:
    """``set_by``: field path -> the ``--set`` override that gave it, so its errors are blamed on the override."""
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source=source, set_by=set_by or {})) from None


def format_validation_error(
    err: ValidationError, *, source: str, set_by: dict[tuple[str, ...], str] | None = None
) -> str:
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "<top level>"
        kind = e["type"]
        where = _error_source(tuple(str(p) for p in e["loc"]), source=source, set_by=set_by or {})
        if kind == "extra_forbidden":
            lines.append(
                f"{where}: unknown field '{field}': remove it or check its spelling"
                f"{_did_you_mean(e['loc'])} (every field: docs/CONFIG.md)"
            )
        elif kind == "missing":
            lines.append(f"{where}: missing required field '{field}': add it to the pipeline file")
        else:
            got = e.get("input")
            got_text = "" if isinstance(got, dict) else f" (got {got!r})"
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"{where}: {field}: {msg}{got_text}" if field != "<top level>" else f"{where}: {msg}")
    return "\n".join(lines)


def _error_source(loc: tuple[str, ...], *, source: str, set_by: dict[tuple[str, ...], str]) -> str:
    """The override that set the field at ``loc`` (or a section holding it), else ``source``; a section-level error
    about a section an override changed names both."""
    for key, override in set_by.items():
        if loc[: len(key)] == key:
            return override
    within = [override for key, override in set_by.items() if key[: len(loc)] == loc and loc]
    return f"{source} (with {', '.join(within)})" if within else source


def _did_you_mean(loc: tuple) -> str:
    """'; did you mean 'temperature'?' for a misspelt field, from the fields of the section that holds it."""
    model: Any = PipelineConfig
    for part in loc[:-1]:
        if isinstance(part, int):
            continue  # an index into a list of sections: the list's item model is already in hand
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            continue  # a key of a mapping of sections (setup.<name>): its value model is already in hand
        annotation = getattr(field, "annotation", None)
        model = next(
            (a for a in (annotation, *getattr(annotation, "__args__", ())) if hasattr(a, "model_fields")), None
        )
        if model is None:
            return ""
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge; values of ``top`` win, lists are replaced, inputs are not modified."""
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _read_yaml(path: Path, *, what: str = "pipeline file") -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"{what} not found: {path} (check the path)")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}{_yaml_problem(err)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (run:, model:, data:, ...)")
    return data


def _yaml_problem(err: yaml.YAMLError) -> str:
    """' line N: not valid YAML (...)', N being the line where the problem starts.

    An unclosed bracket or quote is detected only where the parser runs into something else, often on a later
    line (yaml's problem_mark); the line it was opened on (context_mark) is the one to fix. A block mapping's
    context is merely where that mapping began, so there the problem's own line is the one to name.
    """
    context, problem = getattr(err, "context_mark", None), getattr(err, "problem_mark", None)
    context_text = getattr(err, "context", None) or ""
    what = getattr(err, "problem", None) or str(err).splitlines()[0]
    if context is not None and not context_text.startswith("while parsing a block"):
        seen = f" on line {problem.line + 1}" if problem is not None else ""
        return f" line {context.line + 1}: not valid YAML ({context_text} started on this line: {what}{seen})"
    return f" line {problem.line + 1}: not valid YAML ({what})" if problem else f": not valid YAML ({what})"


def apply_override(raw: dict[str, Any], override: str) -> None:
    key, sep, value_text = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {override!r}: expected KEY=VALUE, e.g. --set generate.temperature=0.7")
    try:
        value = yaml.safe_load(value_text) if value_text.strip() else ""
    except yaml.YAMLError:
        value = value_text
    node = raw
    parts = key.strip().split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {override!r}: '{part}' is not a section")
        node = child
    node[parts[-1]] = value


# The profiles shipped with batchrl (package data: the repository's top-level conf/ links here), the fallback
# after the user's own conf dirs.
SHIPPED_CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def conf_dirs(pipeline_path: Path) -> list[Path]:
    """Where ``profiles:`` are looked for, first match wins: $BATCHRL_CONF_DIR, conf/ beside the pipeline file,
    conf/ beside its directory (a project laid out as pipelines/ + conf/), conf/ in the working directory, and
    last the profiles shipped with batchrl, so a user's own engine/vllm_cpu.yaml overrides the shipped one."""
    pipeline_dir = pipeline_path.resolve().parent
    dirs = [Path(os.environ["BATCHRL_CONF_DIR"])] if os.environ.get("BATCHRL_CONF_DIR") else []
    dirs += [pipeline_dir / "conf", pipeline_dir.parent / "conf", Path.cwd() / "conf", SHIPPED_CONF_DIR]
    return list(dict.fromkeys(dirs))  # the working directory is often the pipeline's: look there once


def _find_profile(name: str, *, pipeline_path: Path) -> Path:
    if not isinstance(name, str) or not name or ".." in name:
        raise ConfigError(f"profiles: invalid profile name {name!r}: use a conf/ relative name like engine/vllm_cpu")
    candidates = [d / f"{name}.yaml" for d in conf_dirs(pipeline_path)]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    searched = ", ".join(str(c) for c in candidates)
    shipped = ", ".join(
        sorted(p.relative_to(SHIPPED_CONF_DIR).with_suffix("").as_posix() for p in SHIPPED_CONF_DIR.rglob("*.yaml"))
    )
    raise ConfigError(
        f"profiles: profile '{name}' not found (looked for {searched}); batchrl ships {shipped}; "
        f"put yours in conf/ beside the pipeline file, or set BATCHRL_CONF_DIR to a directory holding {name}.yaml"
    )
