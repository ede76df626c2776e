"""The ``shardstream`` console script: the command line lives in the native module."""

from __future__ import annotations

import signal
import sys

from . import _native


def main() -> None:
    # Python's SIGINT handler only sets a flag while native code runs: Ctrl-C would do nothing
    # until the command ended, then raise KeyboardInterrupt. The default action makes the
    # command behave as the native binary does (serve installs its own handler and drains).
    # A SIGINT ignored at start (a shell's background job) has no Python handler and stays
    # ignored, as it does for the native binary.
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.exit(_native.cli_main(["shardstream", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
