"""Adapters that plug the connector into serving engines (each imports its engine lazily)."""
