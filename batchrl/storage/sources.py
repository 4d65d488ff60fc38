"""Checks, before a run writes anything, that the places it reads from can be read: a checkpoint named by
model.path (a local directory or a Hugging Face hub id) and object storage (credentials).

Why a rule for model paths: transformers takes any string that is not an existing directory for a hub id, so a
mistyped local path such as ``nosuchdir/model`` was looked up on the hub (retried for about a minute without a
network) and failed only after the run had started writing. The rule (also in ModelConfig.path's description):

- a URI (``s3://...``) names a directory on object storage: read by the loader;
- a hub id is exactly ``owner/name`` (letters, digits, ``_``, ``-``, ``.``) whose ``owner`` is not a file or
  directory here; it must be in the local hub cache ($HF_HOME), or, unless HF_HUB_OFFLINE=1, known to the hub
  (one metadata request, no retries);
- anything else (``/abs``, ``./rel``, ``../rel``, ``~/x``, ``a/b/c``, ``runs/x`` when ``runs/`` exists here) is
  a local path and must be an existing directory.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from batchrl.config import ConfigError, PipelineConfig

logger = logging.getLogger(__name__)

_HUB_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*/[A-Za-z0-9_][A-Za-z0-9_.-]*")
HUB_LOOKUP_TIMEOUT_S = 10.0
_TRUE = {"1", "ON", "YES", "TRUE"}


def is_hub_id(path: str) -> bool:
    """Whether ``path`` reads as a hub id by the rule above (no lookup)."""
    if not _HUB_ID.fullmatch(path) or ".." in path or "--" in path:
        return False
    return not os.path.lexists(path.split("/", 1)[0])  # "runs/x" with a local runs/: a (missing) local path


def check_checkpoint_source(path: str, *, field: str, example: str) -> None:
    """ConfigError naming ``field`` unless ``path`` is an object-store URI, an existing local directory or a hub
    id found in the cache or on the hub (see the module docstring)."""
    if "://" in path and not path.startswith("file://"):
        return
    local = os.path.expanduser(path.removeprefix("file://"))
    if os.path.isdir(local):
        return
    if not is_hub_id(path):
        raise ConfigError(
            f"{field}: {path!r} is neither a local checkpoint directory nor a hub id like {example}; fix the path"
        )
    if _in_hub_cache(path):
        return
    if _hub_offline():
        raise ConfigError(
            f"{field}: {path!r} is neither a local directory nor in the Hugging Face cache "
            f"({_hub_cache()}), and HF_HUB_OFFLINE=1 forbids downloading it; fix the path, or "
            f"download it first (hf download {path})"
        )
    _look_up_on_hub(path, field=field)


def _look_up_on_hub(repo_id: str, *, field: str) -> None:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    not_local = f"{field}: {repo_id!r} is not a local directory ({repo_id.split('/')[0]}/ does not exist here)"
    try:
        HfApi().model_info(repo_id, timeout=HUB_LOOKUP_TIMEOUT_S)
    except GatedRepoError:
        raise ConfigError(
            f"{field}: {repo_id!r} is a gated hub model: accept its terms on the hub and set HF_TOKEN "
            f"(or log in with `hf auth login`)"
        ) from None
    except RepositoryNotFoundError:
        raise ConfigError(
            f"{not_local} and the hub has no model of that name (or it is private: set HF_TOKEN); fix the path"
        ) from None
    except Exception as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(
            f"{not_local}, not in the Hugging Face cache ({_hub_cache()}), and the hub could not be "
            f"reached to look it up ({reason}); fix the path, or download the model first, or check "
            f"the network / HF_ENDPOINT"
        ) from None
    logger.debug("%s: %s found on the hub", field, repo_id)


def _hub_cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _in_hub_cache(repo_id: str) -> bool:
    """A snapshot of ``repo_id`` was downloaded before (what transformers loads offline)."""
    from huggingface_hub.file_download import repo_folder_name

    snapshots = Path(_hub_cache()) / repo_folder_name(repo_id=repo_id, repo_type="model") / "snapshots"
    return snapshots.is_dir() and any(snapshots.iterdir())


def _hub_offline() -> bool:
    from huggingface_hub import constants

    # the environment is read at call time too: huggingface_hub reads it once, when first imported
    return bool(constants.HF_HUB_OFFLINE) or any(
        os.environ.get(name, "").upper() in _TRUE for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def s3_credentials_problem() -> str | None:
    """Why botocore's credential chain (environment, AWS_PROFILE / shared files, container or instance metadata)
    finds no credentials, or None when it finds some. Reads no object."""
    import botocore.exceptions
    import botocore.session

    try:
        credentials = botocore.session.Session().get_credentials()
    except botocore.exceptions.BotoCoreError as err:  # e.g. AWS_PROFILE names a profile that does not exist
        return str(err)
    return None if credentials is not None else "no AWS credentials were found"


def check_s3_credentials(cfg: PipelineConfig) -> None:
    """ConfigError naming the first field of ``cfg`` on S3 when no credentials are found: without them botocore
    fails on the first request with a NoCredentialsError traceback."""
    named = [
        ("run.root", cfg.run.root),
        ("run.init_from", cfg.run.init_from),
        ("model.path", cfg.model.path),
        ("model.tokenizer", cfg.model.tokenizer),
    ] + [("data.train_files", f) for f in cfg.data.train_files]
    if cfg.evaluate is not None:
        named += [("evaluate.files", f) for f in cfg.evaluate.files]
        by_source = cfg.eval_files_by_source()
        named += [(f"data.sources[{name}].eval_files", f) for name, files in by_source.items() for f in files]
    if cfg.score.reward_model is not None:
        named.append(("score.reward_model.path", cfg.score.reward_model.path))
    on_s3 = [(name, uri) for name, uri in named if uri and uri.startswith(("s3://", "s3a://"))]
    if not on_s3:
        return
    problem = s3_credentials_problem()
    if problem is not None:
        name, uri = on_s3[0]
        raise ConfigError(
            f"{name}: {uri} is on S3, but {problem}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
            f"(and AWS_SESSION_TOKEN for temporary ones, AWS_ENDPOINT_URL for an S3-compatible store), "
            f"or AWS_PROFILE naming a profile in ~/.aws/credentials"
        )
