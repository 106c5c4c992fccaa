"""Tests of the ``hora`` launcher and CLI (a package so that helpers import relatively)."""
