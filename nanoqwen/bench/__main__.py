"""`python -m nanoqwen.bench`: the same benchmark as `nanoqwen bench`, its failures one line
each as the CLI prints them (NANOQWEN_DEBUG=1 shows the traceback)."""

import argparse
import sys

from nanoqwen.bench import add_arguments, run
from nanoqwen.errors import debug, exit_code, one_line

PROG = "python -m nanoqwen.bench"
parser = argparse.ArgumentParser(prog=PROG)
add_arguments(parser)
args = parser.parse_args()
try:
    sys.exit(run(args))
except Exception as e:
    if debug():
        raise
    print(f"{PROG}: error: {one_line(e)}", file=sys.stderr)
    sys.exit(exit_code(e))
