"""`python -m castspec ...` runs the command line (what the `castspec` script runs)."""
import sys

from .cli import main

sys.exit(main())
