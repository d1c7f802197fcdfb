import sys

from vegaserve.server.cli import main

if __name__ == "__main__":  # the multi-device executor's spawned workers import this module too
    sys.exit(main())
