"""`python -m loadtest serve --base-url URL ...`"""

import sys

from loadtest.cli import main

sys.exit(main())
