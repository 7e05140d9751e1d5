"""`python -m highrank` runs the same command line as the `highrank` script."""

from highrank.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
