"""Chunk stages shared by several recurrence families, and the float64 reference loop."""
