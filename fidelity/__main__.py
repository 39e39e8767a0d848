"""``python -m fidelity``: the ``fidelity`` command."""

import sys

from fidelity.cli import main

sys.exit(main())
