"""The engine's settings as command-line flags: `tandem serve|engine|bench` add the model, cache,
scheduler and KV-transfer flags from the config dataclasses (`config.py`, where each setting is
declared once) and build the `EngineConfig` back from parsed arguments.

It sits in the engine's distribution so that the shared runtime's option machinery
(`tandem.options`) never imports the engine: a frontend-only install has none.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from tandem.engine_service.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig, SchedulerConfig
from tandem.options import add_flags, from_args

ENGINE_CONFIGS = (ModelConfig, CacheConfig, SchedulerConfig, KVTransferConfig)


def add_engine_flags(parser: argparse.ArgumentParser, defaults: Mapping[str, Any] | None = None) -> None:
    """The model, cache, scheduler and KV-transfer flags (from EngineConfig's parts)."""
    group = parser.add_argument_group("model and engine")
    for cls in ENGINE_CONFIGS:
        add_flags(group, cls, defaults)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The `EngineConfig` of parsed `add_engine_flags` arguments (each part validates itself)."""
    return EngineConfig(*(from_args(cls, args) for cls in ENGINE_CONFIGS))
