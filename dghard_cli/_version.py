"""The package version: one constant, importable without the public API's names."""

__version__ = "0.1.0"
