"""llmgw.scheduler."""
