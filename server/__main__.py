import sys

from vegaserve.server.cli import main

sys.exit(main())
