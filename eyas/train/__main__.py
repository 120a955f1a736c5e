"""``python -m eyas.train eagle3|mtp --data ... --out ...`` (what ``torchrun --nproc_per_node N -m eyas.train`` runs)."""

import sys

from eyas.train.command import main

sys.exit(main())
