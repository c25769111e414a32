import sys

from grains.cli.main import main

sys.exit(main())
