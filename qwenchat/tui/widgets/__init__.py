"""The chat screen's widgets, one per concept."""
