"""Benchmarks of kaitian_ros (kaitian bench ...)."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class BenchArgumentParser(argparse.ArgumentParser):
    """Argument parser whose mistakes are one line on stderr and exit code 2 (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)
