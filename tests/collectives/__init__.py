"""Tests of the collective algorithms (a package so that helpers import relatively)."""
