"""Training of the demo pair (see README.md): runs in PyTorch + transformers, apart from the exporter."""
