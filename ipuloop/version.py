"""The package version, a leaf every module may read."""

__version__ = "0.2.0"
