"""``python -m megacomp.plan``: see megacomp.plan.cli."""
import sys

from .cli import main

sys.exit(main())
