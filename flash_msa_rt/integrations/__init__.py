"""Optional integrations with other libraries. Each module imports its library itself (an extra of the
distribution: `pip install flash-msa-rt[transformers]`); the runtime core never imports any of them."""
