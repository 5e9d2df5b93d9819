"""Adapters that plug the ems pool into serving engines (each imports its engine lazily:
importing ``ems`` never imports them)."""
