import sys

from jobd.cli import main

sys.exit(main())
