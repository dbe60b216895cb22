"""`tern` and `python -m frontend`: the command line's entry point (frontend/server/launcher.py).

NOTE: multiprocessing's spawn runs the parent's main module again in every process it starts
(the engine core, then each worker): this module imports nothing at its top, so that those
processes load only what they run, not the frontend and transformers (1.5 s of CPU each).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    import logging
    import os

    from frontend.server.launcher import main as launch

    code = launch(argv)
    # The server has stopped and its engine processes are gone (or were killed): exit without
    # the interpreter's teardown, whose garbage collection over torch's and transformers'
    # modules takes seconds after every stop.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
