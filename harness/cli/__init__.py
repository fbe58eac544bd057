"""The ``kharness`` command line: ``entry`` is the console script."""

from harness.cli.main import EXIT_BAD_INPUT, EXIT_NO_HARDWARE, build_parser, entry, main

__all__ = ["EXIT_BAD_INPUT", "EXIT_NO_HARDWARE", "build_parser", "entry", "main"]
