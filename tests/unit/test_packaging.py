"""The dev extras install at once on top of `make demo`'s environment: the S3 stack (boto3, moto, aiobotocore, s3fs)
is pinned to one set whose botocore ranges meet. Unpinned, pip tried every boto3 release newer than the one
aiobotocore's botocore range allows, for minutes (issue 30, item 7)."""

from __future__ import annotations

import sys
from importlib.metadata import requires, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement

if sys.version_info >= (3, 11):
    import tomllib
else:
    tomllib = pytest.importorskip("tomli")

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
S3_STACK = ("boto3", "moto", "aiobotocore", "s3fs")


def dev_requirements() -> dict[str, Requirement]:
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    return {req.name: req for req in map(Requirement, extras["dev"])}


def botocore_range(package: str):
    """The botocore versions the installed ``package`` accepts (its requirement outside any extra)."""
    found = [Requirement(r) for r in requires(package) or []]
    (botocore,) = [r for r in found if r.name == "botocore" and r.marker is None]
    return botocore.specifier


def test_the_s3_test_stack_is_pinned_to_one_version_each():
    dev = dev_requirements()
    pins = {name: [(s.operator, s.version) for s in dev[name].specifier] for name in S3_STACK if name in dev}
    assert set(pins) == set(S3_STACK) and all(len(p) == 1 and p[0][0] == "==" for p in pins.values()), pins


def test_the_pinned_boto3_and_aiobotocore_accept_one_botocore():
    dev = dev_requirements()
    for name in ("boto3", "aiobotocore"):
        (pin,) = dev[name].specifier
        if version(name) != pin.version:
            pytest.skip(f"{name} {version(name)} is installed, not the pinned {pin.version}: run make install")
    botocore = version("botocore")
    assert botocore in botocore_range("boto3") and botocore in botocore_range("aiobotocore")
