"""batchrl installed from a wheel, as `pip install batchrl` installs it, runs a pipeline file outside the checkout:
the profiles come with the package, and a user's own conf dir overrides them.

The wheel is built from a copy of this working tree (building in place would write build/ and an egg-info into
the checkout that other processes share) and installed without dependencies into a fresh venv, which sees the
repository venv's packages through a path line in a .pth file. A path line adds the directory only, without
processing that directory's own .pth files, so the repository's editable batchrl (an import hook its
__editable__ .pth installs) stays out: the venv imports the wheel's batchrl, which the fixture checks.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml
from harness import REPO, write_yaml

pytestmark = pytest.mark.slow  # a wheel build, a venv and three CLI runs: ~10 s on 2 loaded cores

PROFILES = ["engine/vllm_cpu", "trainer/cpu_gloo", "cluster/local"]


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A venv holding batchrl from a wheel of this working tree (not editable) and no copy of conf/."""
    root = tmp_path_factory.mktemp("installed")
    source = root / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for package in ("batchrl", "batchrl_toy"):
        shutil.copytree(REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", root / "wheels", source], cwd=root)
    (wheel,) = (root / "wheels").glob("batchrl-*.whl")
    run([sys.executable, "-m", "venv", "--without-pip", root / "venv"], cwd=root)
    python = root / "venv" / "bin" / "python"
    run([*pip, "--python", python, "install", "--no-deps", "--no-index", wheel], cwd=root)
    site_packages = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root)
    # After the venv's own site-packages: the wheel's batchrl comes first, the dependencies from the repo's venv.
    (Path(site_packages.stdout.strip()) / "batchrl_test_dependencies.pth").write_text(
        sysconfig.get_paths()["purelib"] + "\n"
    )
    imported = run([python, "-c", "import batchrl; print(batchrl.__file__)"], cwd=root)
    assert Path(imported.stdout.strip()).is_relative_to(root / "venv"), imported.stdout
    return root / "venv"


def run(command: list, *, cwd: Path, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """``command`` in ``cwd`` with this environment less PYTHONPATH and BATCHRL_CONF_DIR (the tests' own, which
    would reach into the checkout), plus ``env``."""
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "BATCHRL_CONF_DIR")}
    done = subprocess.run(
        [str(part) for part in command], cwd=cwd, env={**environ, **(env or {})}, capture_output=True, text=True
    )
    if check and done.returncode != 0:
        raise AssertionError(f"{command} exited {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return done


def user_pipeline(directory: Path, *, profiles: list[str] = PROFILES) -> Path:
    """A pipeline file of a user's own project: nothing of the checkout beside it."""
    directory.mkdir(parents=True, exist_ok=True)
    raw = {
        "name": "mine",
        "profiles": profiles,
        "model": {"path": str(directory / "model")},
        "data": {"train_files": [str(directory / "prompts")]},
    }
    return write_yaml(directory / "mine.yaml", raw)


def validate(venv: Path, pipeline: Path, *, env: dict | None = None, check: bool = True):
    return run([venv / "bin" / "batchrl", "validate", pipeline], cwd=pipeline.parent, env=env, check=check)


def test_an_installed_batchrl_resolves_the_shipped_profiles_outside_the_checkout(venv, tmp_path):
    pipeline = user_pipeline(tmp_path / "project")
    resolved = yaml.safe_load(validate(venv, pipeline).stdout)
    assert resolved["generate"]["engine"] == "vllm" and resolved["generate"]["enforce_eager"] is True  # engine/vllm_cpu
    assert resolved["update"]["backend"] == "gloo" and resolved["update"]["num_processes"] == 2  # trainer/cpu_gloo
    assert resolved["ray"]["address"] is None  # cluster/local
    plan = run([venv / "bin" / "batchrl", "plan", pipeline], cwd=pipeline.parent)
    assert "iter 0 generate" in plan.stdout and not (pipeline.parent / "runs").exists()  # plan writes nothing


def test_a_profile_in_the_users_conf_dir_overrides_the_shipped_one(venv, tmp_path):
    pipeline = user_pipeline(tmp_path / "project")
    own = tmp_path / "my_conf"
    write_yaml(own / "engine" / "vllm_cpu.yaml", {"generate": {"engine": "hf", "num_actors": 3}})
    resolved = yaml.safe_load(validate(venv, pipeline, env={"BATCHRL_CONF_DIR": str(own)}).stdout)
    assert (resolved["generate"]["engine"], resolved["generate"]["num_actors"]) == ("hf", 3)  # the user's
    assert resolved["update"]["backend"] == "gloo"  # trainer/cpu_gloo: the user has none, the shipped one is used


def test_a_profile_that_exists_nowhere_is_a_config_error_naming_where_it_looked(venv, tmp_path):
    pipeline = user_pipeline(tmp_path / "project", profiles=["engine/vllm_tpu"])
    done = validate(venv, pipeline, check=False)
    assert done.returncode == 2, done.stderr
    assert "engine/vllm_tpu" in done.stderr and "BATCHRL_CONF_DIR" in done.stderr
    assert str(venv) in done.stderr  # the shipped profiles were looked at too
    assert "Traceback" not in done.stderr
