"""``python -m bagf_torch``: see ``bagf_torch.cli``."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
