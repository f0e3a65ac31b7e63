"""`python -m ferrobatch serve|generate|chat`."""

import sys

from ferrobatch.cli import main

sys.exit(main())
