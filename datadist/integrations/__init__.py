"""Adapters that plug datadist into serving engines (each imports its engine lazily:
importing ``datadist`` never imports them)."""
