"""attention_svc package."""
