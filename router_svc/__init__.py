"""router_svc package."""
