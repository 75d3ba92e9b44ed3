"""Compatibility shims (applied explicitly, never on import)."""
