"""Data (layer 4): local text tasks built from Debian package descriptions; see `debian`."""

from specdec.data.debian import DATASETS, SPLITS, load

__all__ = ["DATASETS", "SPLITS", "load"]
