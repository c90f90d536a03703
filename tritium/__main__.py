"""`python -m tritium ...`: see tritium/cli.py."""
from .cli import main

raise SystemExit(main())
