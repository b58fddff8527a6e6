"""``python -m shmstore.spill``: the spill process of one node store."""
import sys

from .process import main

sys.exit(main())
