"""``python -m spec_tot``: the ``spec-tot`` command."""

from spec_tot.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
