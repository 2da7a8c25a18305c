"""llmgw: an event-sourced control plane for running LLMs on GPU fleets."""

__version__ = "0.1.0"
