"""hora's version (its own module, so reading it loads nothing else)."""

__version__ = "0.1.0"
