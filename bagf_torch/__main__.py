"""``python -m bagf_torch``: see ``bagf_torch.cli``.

Once the command has returned, the process ends with ``os._exit`` after flushing its output, its log handlers and
closing the runtime (isolated workers stopped, the cache closed): Python's own shutdown would have nothing of ours
left to do, and after a tuning it took 1.5-2.2 s on the H200's host (tearing down the modules Ax and torchvision
import, and CUDA's context: benchmarks/probes/exit_cost.py), over a second of every ``tune`` command. So no
atexit handler runs: nothing a command does may depend on one. A command that raises ends the usual way.
"""

import logging
import os
import sys

from .cli import main


def _end(code) -> None:
    """``sys.exit(code)``'s status (None 0, an int itself, anything else 1), by ``os._exit``."""
    from . import runtime

    try:
        runtime.reset()
    finally:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe: nothing more can reach it
                pass
        os._exit(0 if code is None else code if isinstance(code, int) else 1)


if __name__ == "__main__":
    _end(main())
