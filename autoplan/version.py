"""The package version (one place: the plan file records it, ``autoplan --version`` prints it)."""

__version__ = "0.1.0"
