"""The ``llmgw`` command line."""
