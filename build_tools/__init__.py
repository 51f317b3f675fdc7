"""Ahead-of-time build of the kernel catalogue into artifacts/<arch>/ (cubins + manifest.json). No GPU needed."""
