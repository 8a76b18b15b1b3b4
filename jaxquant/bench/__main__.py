"""`python -m jaxquant.bench ...`, the same as `python -m jaxquant bench ...`."""

import sys

from jaxquant.bench import main

sys.exit(main())
