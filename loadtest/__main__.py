"""`python -m kvserve.loadtest serve --base-url URL ...`"""

import sys

from kvserve.loadtest.cli import main

sys.exit(main())
