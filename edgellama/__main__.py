"""`python -m edgellama ...`: the edgellama command, for environments without its script."""
from .cli.main import main

main(prog_name="edgellama")
