"""Elastic mode of `hora run`: host discovery, host health, and the driver."""
