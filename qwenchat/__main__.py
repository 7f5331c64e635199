"""`python -m qwenchat` runs the command-line interface."""

from qwenchat.cli import main

main()
