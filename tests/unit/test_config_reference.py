"""docs/CONFIG.md is generated from the models' field descriptions and must not drift from them."""

from __future__ import annotations

from harness import REPO

from batchrl.config.models import ModelConfig
from batchrl.config.reference import render_reference


def test_the_committed_config_reference_is_what_the_models_render():
    committed = (REPO / "docs" / "CONFIG.md").read_text()
    assert committed == render_reference(), (
        "docs/CONFIG.md differs from the field descriptions in batchrl/config/; regenerate it with "
        "`.venv/bin/python -m batchrl.config.reference docs/CONFIG.md`"
    )


def test_the_reference_lists_every_field_of_nested_sections_with_its_default():
    text = render_reference()
    assert "| `generate.temperature` | float (>= 0.0) | `1.0` |" in text
    assert "## `score.rewards[]`" in text and "| `score.rewards[].weight` |" in text
    assert "| `model.path` | str | required |" in text
    assert all(f"`model.{name}`" in text for name in ModelConfig.model_fields)


def test_error_messages_point_to_a_reference_that_exists():
    loader = (REPO / "batchrl" / "config" / "loader.py").read_text()
    assert "docs/CONFIG.md" in loader and (REPO / "docs" / "CONFIG.md").is_file()
