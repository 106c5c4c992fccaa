"""Leaf helpers: logging, networking, timing. Import nothing else from hora but errors/config."""
