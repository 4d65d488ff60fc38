"""Loading a pipeline: YAML file + conf/ profiles + ``--set a.b=c`` overrides -> PipelineConfig.

Precedence, lowest first: profiles (in the order listed), the pipeline file, ``--set`` overrides.
Errors are ``ConfigError`` with one line per problem naming the field, so the CLI can print them and exit 2.
Loading reads only the pipeline and profile files; it never touches data, object storage or a GPU.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from batchrl.config.models import PipelineConfig


class ConfigError(ValueError):
    """A user's configuration mistake; the message says which field and how to fix it."""


def load_pipeline(path: str | os.PathLike, *, overrides: list[str] = (), run_id: str | None = None) -> PipelineConfig:
    path = Path(path)
    raw = _read_yaml(path)
    for override in overrides:
        _apply_override(raw, override)
    profile_names = raw.get("profiles") or []
    if not isinstance(profile_names, list):
        raise ConfigError("profiles: must be a list of conf/ profile names, e.g. [engine/vllm_cpu]")
    merged: dict[str, Any] = {}
    for name in profile_names:
        merged = deep_merge(merged, _read_yaml(_find_profile(name, pipeline_path=path), what=f"profile {name}"))
    merged = deep_merge(merged, raw)
    if run_id is not None:
        merged.setdefault("run", {})["id"] = run_id
    return validate_dict(merged, source=str(path))


def validate_dict(raw: dict[str, Any], *, source: str = "<config>") -> PipelineConfig:
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source=source)) from None


def format_validation_error(err: ValidationError, *, source: str) -> str:
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "<top level>"
        kind = e["type"]
        if kind == "extra_forbidden":
            lines.append(f"{source}: unknown field '{field}': remove it or check its spelling "
                         f"(see `batchrl validate --help` / docs/CONFIG.md)")
        elif kind == "missing":
            lines.append(f"{source}: missing required field '{field}': add it to the pipeline file")
        else:
            got = e.get("input")
            got_text = "" if isinstance(got, dict) else f" (got {got!r})"
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"{source}: {field}: {msg}{got_text}" if field != "<top level>" else f"{source}: {msg}")
    return "\n".join(lines)


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
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{where}: not valid YAML ({getattr(err, 'problem', err)})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (run:, model:, data:, ...)")
    return data


def _apply_override(raw: dict[str, Any], override: str) -> None:
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


def conf_dirs(pipeline_path: Path) -> list[Path]:
    dirs = []
    if os.environ.get("BATCHRL_CONF_DIR"):
        dirs.append(Path(os.environ["BATCHRL_CONF_DIR"]))
    dirs += [pipeline_path.resolve().parent.parent / "conf", Path.cwd() / "conf"]
    return dirs


def _find_profile(name: str, *, pipeline_path: Path) -> Path:
    if not isinstance(name, str) or not name or ".." in name:
        raise ConfigError(f"profiles: invalid profile name {name!r}: use a conf/ relative name like engine/vllm_cpu")
    candidates = [d / f"{name}.yaml" for d in conf_dirs(pipeline_path)]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    searched = ", ".join(str(c) for c in candidates)
    raise ConfigError(f"profiles: profile '{name}' not found (looked for {searched}); "
                      f"list conf/ for available profiles or set BATCHRL_CONF_DIR")
