import sys

from ..cli import main

# `te-core demo` itself, so that the command's error handling (a closed pipe, an unwritable path) applies
sys.exit(main(["demo", *sys.argv[1:]]))
