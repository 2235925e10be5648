import sys

from pdasgd_jax.cli import main

sys.exit(main())
