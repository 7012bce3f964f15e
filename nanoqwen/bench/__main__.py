"""`python -m nanoqwen.bench`: the same benchmark as `nanoqwen bench`."""

import argparse
import sys

from nanoqwen.bench import add_arguments, run

parser = argparse.ArgumentParser(prog="python -m nanoqwen.bench")
add_arguments(parser)
sys.exit(run(parser.parse_args()))
