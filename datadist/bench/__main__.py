"""``python -m datadist.bench``."""
import sys

from . import main

sys.exit(main())
