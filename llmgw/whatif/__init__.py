"""llmgw.whatif."""
