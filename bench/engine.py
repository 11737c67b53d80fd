"""`python bench/engine.py [args]`: the same as `helexa bench engine [args]`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from helexa.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "engine", *sys.argv[1:]]))
