"""llmgw.engine."""
