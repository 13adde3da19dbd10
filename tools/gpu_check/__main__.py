"""``python3 -m tools.gpu_check OUTDIR`` (see ``tools.gpu_check``)."""

import sys

from tools.gpu_check.cli import main

if __name__ == "__main__":
    sys.exit(main())
