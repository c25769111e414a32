import sys

from silo.process import main

sys.exit(main())
