"""``python -m flashdsa`` (and ``torchrun ... -m flashdsa finetune``): the flashdsa command line."""

import sys

from flashdsa.cli import main

if __name__ == "__main__":
    sys.exit(main())
