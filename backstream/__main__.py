"""`python -m backstream ...` is the `backstream` command; under torchrun too:

    torchrun --nproc_per_node 8 -m backstream train run.toml
"""

from backstream.cli import entry

entry()
