"""control_svc package."""
