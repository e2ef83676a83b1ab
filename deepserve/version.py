"""The package version, in a module of its own so that any floor can read it without importing the engine."""

__version__ = "0.1.0"
