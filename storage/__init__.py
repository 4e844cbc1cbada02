"""Zarr replay stores, their schema, xarray views, and learner checkpoints.

Imports only numpy, zarr, xarray, orbax and the standard library (never marl, pipelines
or flows); xarray and orbax are imported lazily, on first use.
"""

from .checkpoints import Checkpointer
from .replay import SCHEMA_VERSION, Field, ReplayStore, StoreError, open_replay

__all__ = ["ReplayStore", "open_replay", "Checkpointer", "StoreError", "SCHEMA_VERSION", "Field"]
