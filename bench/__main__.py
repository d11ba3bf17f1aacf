"""``python -m bench``: the side-by-side suite (bench/suite.py; see bench/README_suite.md)."""

import sys

from bench.suite import main

sys.exit(main())
