import sys

from tests.parity.harness import main

if __name__ == "__main__":
    sys.exit(main())
