import os
import sys

# shared test helpers (MiniSwarm, ...) live in tests/support; adding tests/
# itself to sys.path would let tests/netsim shadow the netsim package
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "support"))
