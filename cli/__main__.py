"""``python -m pdserve.cli``: the same as the ``pdserve`` console script."""

import sys

from pdserve.cli.main import main

sys.exit(main())
