"""The package version, in one place (the façade and the server both report it)."""

__version__ = "0.1.0"
