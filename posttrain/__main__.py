import sys

from posttrain.cli import main

sys.exit(main())
