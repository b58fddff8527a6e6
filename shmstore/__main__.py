"""``python -m shmstore``: the shmstore command."""
import sys

from .cli import main

sys.exit(main())
