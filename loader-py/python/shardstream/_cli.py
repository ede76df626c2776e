"""The ``shardstream`` console script: the command line lives in the native module."""

from __future__ import annotations

import sys

from . import _native


def main() -> None:
    sys.exit(_native.cli_main(["shardstream", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
