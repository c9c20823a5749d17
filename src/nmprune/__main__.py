"""``python -m nmprune ...`` (and ``torchrun ... -m nmprune prune ...``): the command line."""

import sys

from .cli import main

sys.exit(main())
