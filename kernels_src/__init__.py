"""CuTeDSL kernel sources and their build specs (build time only: the runtime never imports this package)."""
