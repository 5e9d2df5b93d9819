"""The version of the distribution that ships ``datadist`` and ``ems``."""

__all__ = ["__version__"]

__version__ = "0.1.0"
