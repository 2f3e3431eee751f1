import sys

from posttrain.cli import main

if __name__ == "__main__":  # the engine's process (posttrain.serve.core) imports this module again: no rerun there
    sys.exit(main())
