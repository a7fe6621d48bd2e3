"""Token-mixing recurrences: one sub-package per family (see ALGORITHMS.md)."""
