"""`python -m hookpolicy`: the same command line as the `hookpolicy` script."""

from .cli import main

if __name__ == "__main__":
    main()
