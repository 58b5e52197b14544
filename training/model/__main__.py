"""`python -m training.model fetch|verify`: the model folder's command line (training/model/folder.py)."""

import sys

from training.model.folder import main

sys.exit(main())
