"""``python -m ems.server``: same as the ``ems-server`` console script."""
import sys

from . import main

sys.exit(main())
