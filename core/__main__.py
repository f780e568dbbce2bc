"""``python -m deepinfer``: the ``deepinfer`` command line (what ``torchrun -m deepinfer generate ...`` runs)."""

import sys

from .cli import main

sys.exit(main())
