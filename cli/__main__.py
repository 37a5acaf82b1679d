"""`python -m cli`: the same as the `omni` console script."""

from cli.main import main

main()
