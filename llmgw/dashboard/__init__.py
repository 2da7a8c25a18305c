"""llmgw.dashboard."""
