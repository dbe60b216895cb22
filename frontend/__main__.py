"""`tern` and `python -m frontend`: the command line's entry point (frontend/server/launcher.py).

NOTE: multiprocessing's spawn runs the parent's main module again in every process it starts
(the engine core, then each worker): this module imports nothing at its top, so that those
processes load only what they run, not the frontend and transformers (1.5 s of CPU each).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from frontend.server.launcher import main as launch

    return launch(argv)


if __name__ == "__main__":
    sys.exit(main())
