"""`python -m nanoqwen`: the same as the `nanoqwen` command."""

from nanoqwen.cli import main

raise SystemExit(main())
