"""Pipeline configuration: typed models and the YAML loader."""

from batchrl.config.loader import ConfigError, load_pipeline, validate_dict
from batchrl.config.models import PipelineConfig

__all__ = ["ConfigError", "PipelineConfig", "load_pipeline", "validate_dict"]
