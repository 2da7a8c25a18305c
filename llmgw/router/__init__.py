"""llmgw.router."""
