"""`python -m mlxcluster.lab up|down|status`: the lab's command line (mlxcluster/lab/hosts.py)."""

import sys

from mlxcluster.lab.hosts import main

sys.exit(main())
