"""llmgw.planner."""
