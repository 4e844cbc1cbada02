"""Zarr replay stores, their schema, xarray views, derived groups (reanalysis) and learner
checkpoints. Episode tables are in storage.episodes, Minari export in storage.minari_export.

Imports only numpy, zarr, xarray, dask, orbax and the standard library (never marl,
pipelines or flows); xarray, dask and orbax are imported lazily, on first use.
"""

from .checkpoints import Checkpointer
from .derived import DerivedGroup, open_derived
from .replay import SCHEMA_VERSION, Field, ReplayDamaged, ReplayStore, StoreError, open_replay

__all__ = ["ReplayStore", "open_replay", "Checkpointer", "StoreError", "ReplayDamaged", "SCHEMA_VERSION", "Field",
           "DerivedGroup", "open_derived"]
