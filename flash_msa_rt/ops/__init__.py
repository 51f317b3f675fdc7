"""Public ops: torch-facing functions that validate inputs, pick a variant and launch it."""
