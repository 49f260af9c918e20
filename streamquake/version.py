"""The version of streamquake, in one place: the package root and every part that writes it."""

__version__ = "0.1.0"
