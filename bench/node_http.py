"""`python bench/node_http.py [args]`: the same as `helexa bench node [args]`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from helexa.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "node", *sys.argv[1:]]))
