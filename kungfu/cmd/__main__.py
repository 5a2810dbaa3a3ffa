"""`python -m kungfu.cmd` runs kungfu-run."""
import sys

from kungfu.cmd import main

if __name__ == "__main__":
    sys.exit(main())
