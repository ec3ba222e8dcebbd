"""expert_svc package."""
