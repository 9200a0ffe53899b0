"""`python -m zerotier.cli`: the `zerotier` command."""
import sys

from zerotier.cli import main

sys.exit(main())
