import sys

from ba_jax.native import main

sys.exit(main(sys.argv))
