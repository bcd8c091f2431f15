"""The ``idpsgd`` command line; see :mod:`.main`."""

from .main import build_parser, main

__all__ = ["build_parser", "main"]
